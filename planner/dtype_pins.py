"""Where a model's code pins values to float32: what an fp32 trace of it cannot run in bf16.

The planning capture runs the model in fp32. There, a ``.to(torch.float32)``, ``.float()`` or
``.to(x.dtype)`` is a no-op that leaves only export's ``_assert_tensor_metadata(dtype=torch.float32)``
in the graph, and a cast from integers (``position_ids.float()``) is a real cast to fp32. Run with
bf16 parameters such a graph would compute Hugging Face's RMSNorm variance in bf16 where the model
computes it in fp32, or mix fp32 values into bf16 matmuls. So the graphs ranks compile for a bf16
or fp16 plan are traced in that dtype (:mod:`planner.trace_dtype`), and the mixed-precision pass
(``passes.dp.graph.cast_io``) refuses a graph traced in fp32 that has pins, naming their lines.

A graph traced in the plan's dtype can hold the opposite mistake, the model's own: a float32
buffer (a sinusoidal position table, a relative-position bias, a frozen norm's statistics) or an
upcast that is never cast back meets a bf16 value in an op whose kernel takes one dtype: a matmul
("mat1 and mat2 must have the same dtype"), a norm, an indexed write (:data:`MIXED_OPS` lists them,
from eager PyTorch's own answers). torch.export's fake kernels do not check it, so the trace records
it and the ranks would crash at their first step. :func:`mixed_ops` finds those nodes, and the
mixed-precision pass refuses the plan before launch with :func:`mixed_problem`, naming module, op
and line.

Usage::

    pins = fp32_pins(graph)     # ["hidden_states.to(torch.float32) (modeling_llama.py:62 `...`)", ...]
    mixed = mixed_ops(gm)       # [linear node, ...]; mixed_problem(mixed, "bf16", path) says where and what to do
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.fx

from planner.batch_stats import batch_stat_call, source_line
from planner.graph import META_MODULE, ModelGraph, module_class

__all__ = ["fp32_pins", "module_pins", "pins_problem", "mixed_ops", "mixed_problem", "MIXED_REMEDY", "PINS_REMEDY",
           "MIXED_OPS", "MixRule", "mix_refused", "op_name", "op_key"]

_ASSERT = "aten._assert_tensor_metadata.default"
_CASTS = {"aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout"}


def _pinned(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = str(node.target)
    dtype = node.kwargs.get("dtype", node.args[1] if target == "aten.to.dtype" and len(node.args) > 1 else None)
    return dtype is torch.float32 and (target == _ASSERT or target in _CASTS)


def fp32_pins(graph: ModelGraph) -> list[str]:
    """One ``node (file:line `code`)`` per place the captured code converts to (or checks for)
    float32, nested graphs (autocast regions) included; empty for a model that never does."""
    return module_pins(graph.gm)


def module_pins(gm: torch.nn.Module) -> list[str]:
    """:func:`fp32_pins` of a graph module (a pass's view of the capture)."""
    found = []
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                if _pinned(node):
                    site = source_line(node)
                    found.append(f"{node.name}{f' ({site})' if site else ''}")
    return found


PINS_REMEDY = ("trace it in the plan's dtype (planner.capture.capture(..., dtype=), as fairscale.parallelize's "
               'ranks do) or plan with "fp32"')
"""What to do about a :func:`pins_problem` refusal."""


def pins_problem(pins: list[str], dtype: str, path: str) -> str:
    """The refusal of a ``dtype`` (bf16 / fp16) plan, at JSON ``path``, of an fp32 trace with ``pins``."""
    shown = "; ".join(pins[:3]) + (f"; and {len(pins) - 3} more" if len(pins) > 3 else "")
    return (f'{path}: "{dtype}" would not compute what this model computes in {dtype}: its code converts values '
            f"to float32 ({shown}), which the fp32 capture records as no-ops or as fp32 values mixed into "
            f"{dtype} matmuls; {PINS_REMEDY}")


@dataclass(frozen=True)
class MixRule:
    """Which floating operands of an op its eager kernel needs to agree in dtype."""

    same: tuple[str, ...]
    """Operands (schema names; each tensor of a list argument) whose dtypes must be one."""
    or_fp32: tuple[str, ...] = ()
    """Operands whose dtypes must be one, either that of :attr:`same` or float32 (the kernels'
    mixed-precision path: a 16-bit input with float32 norm parameters, bias or attention mask)."""
    exact: bool = True
    """False where eager's refusal also depends on more than dtypes (which operands need gradients,
    a flag): the rule then refuses every mix, of which eager refuses some."""


def _same(*names: str) -> MixRule:
    return MixRule(same=names)


_NORM = MixRule(same=("input",), or_fp32=("weight", "bias"))
MIXED_OPS: dict[str, MixRule] = {
    # matmuls: "mat1 and mat2 must have the same dtype", a float32 bias too
    **{f"aten.{op}": _same(*names) for op, names in {
        "linear": ("input", "weight", "bias"), "mm": ("self", "mat2"), "addmm": ("self", "mat1", "mat2"),
        "bmm": ("self", "mat2"), "baddbmm": ("self", "batch1", "batch2"), "addbmm": ("self", "batch1", "batch2"),
        "matmul": ("self", "other"), "einsum": ("tensors",), "mv": ("self", "vec"), "addmv": ("self", "mat", "vec"),
        "dot": ("self", "tensor"), "tensordot": ("self", "other"), "bilinear": ("input1", "input2", "weight"),
        "_grouped_mm": ("self", "mat2"),
        "conv1d": ("input", "weight", "bias"), "conv2d": ("input", "weight", "bias"),
        "conv3d": ("input", "weight", "bias"), "conv_transpose3d": ("input", "weight", "bias"),
        # elementwise or indexed, yet without type promotion
        "prelu": ("self", "weight"), "lerp": ("self", "end", "weight"), "linalg_cross": ("self", "other"),
        "grid_sampler": ("input", "grid"), "embedding_bag": ("weight", "per_sample_weights"),
        "cross_entropy_loss": ("self", "weight"), "nll_loss_nd": ("self", "weight"),
        "binary_cross_entropy": ("self", "target"),
        # writes of one tensor into another: "Index put requires the source and destination dtypes match"
        "index_put": ("self", "values"), "index_add": ("self", "source"), "index_copy": ("self", "source"),
        "index_reduce": ("self", "source"), "put": ("self", "source"), "masked_scatter": ("self", "source"),
        "scatter": ("self", "src"), "scatter_add": ("self", "src"), "scatter_reduce": ("self", "src"),
    }.items()},
    "aten.conv_transpose1d": _same("input", "weight"),  # a bias of either dtype passes
    "aten.conv_transpose2d": MixRule(same=("input", "weight"), or_fp32=("bias",)),
    "aten.scaled_dot_product_attention": MixRule(same=("query", "key", "value"), or_fp32=("attn_mask",)),
    "aten.layer_norm": _NORM, "aten.group_norm": _NORM, "aten.instance_norm": _NORM,
    "aten.batch_norm": MixRule(same=("input",), or_fp32=("weight", "bias", "running_mean", "running_var")),
    # a float32 bias passes or not by the convolution's rank and transposition; the LSTM's biases by
    # layer; the outer product's backward by which operands need gradients
    "aten.convolution": MixRule(same=("input", "weight", "bias"), exact=False),
    "aten._convolution": MixRule(same=("input", "weight", "bias"), exact=False),
    "aten.lstm": MixRule(same=("input", "hx", "params"), exact=False),
    "aten.addr": MixRule(same=("self", "vec1", "vec2"), exact=False),
}
"""The ATen ops whose eager CPU kernels (forward or backward) refuse some floating operands of
different dtypes, by op (any overload; an in-place ``op_`` as ``op``); every other op takes them by
type promotion. The evidence, and how to gather it again, is benchmarks/dtype_ops/ (each op run
under every bf16 / float32 mix of its operands); tests/planner/test_mixed_dtype_ops.py checks each
rule against eager PyTorch."""


def mix_refused(op: str, dtypes: Mapping[str, Sequence[torch.dtype]]) -> bool:
    """Whether op ``op`` (``"aten.layer_norm"``) refuses operands of ``dtypes`` (floating dtypes by
    schema name, a list argument's in order), by :data:`MIXED_OPS`."""
    rule = MIXED_OPS.get(op)
    if rule is None:
        return False
    same = {d for name in rule.same for d in dtypes.get(name, ())}
    loose = {d for name in rule.or_fp32 for d in dtypes.get(name, ())}
    return len(same) > 1 or len(loose) > 1 or bool(same and loose and loose != same and loose != {torch.float32})


def op_name(node: torch.fx.Node) -> str | None:
    """The :data:`MIXED_OPS` key of an ATen call (``aten.index_put_.default`` -> ``"aten.index_put"``)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    return op_key(node.target)


def op_key(op: torch._ops.OpOverload) -> str:
    """:func:`op_name` of a call of ``op``."""
    return str(op.overloadpacket).removesuffix("_")


def _dtypes(arg: object) -> list[torch.dtype]:
    """The floating dtypes of an operand's recorded values, each tensor of a list argument's in order."""
    if isinstance(arg, (list, tuple)):
        return [d for a in arg for d in _dtypes(a)]
    dtype = _val_dtype(arg)
    return [dtype] if dtype is not None else []


def _operands(node: torch.fx.Node) -> dict[str, list[torch.dtype]]:
    """The floating dtypes of an ATen call's operands, by schema name."""
    assert isinstance(node.target, torch._ops.OpOverload)
    out = {}
    for i, arg in enumerate(node.target._schema.arguments):
        found = _dtypes(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
        if found:
            out[arg.name] = found
    return out


def _module_of(node: torch.fx.Node) -> str:
    """`` in module PATH (Class)``: the path the capture recorded (``META_MODULE``, normalized there),
    the class from export's ``nn_module_stack``; '' for a node outside every module's call."""
    name = module_class(node)
    return f" in module {node.meta.get(META_MODULE) or '(top)'} ({name})" if name else ""


def mixed_ops(gm: torch.nn.Module) -> list[torch.fx.Node]:
    """The ops of ``gm`` (nested graphs included) that :data:`MIXED_OPS` says refuse their operands'
    dtypes, in graph order. A training-mode batch norm of the top graph is left out: the batch-norm
    pass replaces it with kernels of its own (``passes.ops.bn_ops``), which take float32 statistics."""
    found = []
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            name = op_name(node)
            if name in MIXED_OPS and mix_refused(name, _operands(node)) and \
                    not (module is gm and batch_stat_call(node, gm) is not None):
                found.append(node)
    return found


def _operand_dtypes(node: torch.fx.Node) -> list[torch.dtype]:
    """The distinct dtypes of the operands that :data:`MIXED_OPS` says ``node`` needs to agree."""
    rule, operands = MIXED_OPS[op_name(node) or ""], _operands(node)
    return list(dict.fromkeys(d for name in (*rule.same, *rule.or_fp32) for d in operands.get(name, ())))


def _val_dtype(node: object) -> torch.dtype | None:
    """The dtype of a node's recorded floating value; None for anything else."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) and val.is_floating_point() else None


def origin(node: torch.fx.Node) -> torch.fx.Node | None:
    """Where the float32 operand of the mixed ``node`` became float32: the first node (in graph
    order) among its float32 ancestors that reads a lower-precision value (``x + fp32_buffer``,
    ``x.float()``), or None if every float32 ancestor is float32 throughout."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    seen, todo, found = set(), [a for a in node.all_input_nodes if _val_dtype(a) is torch.float32], []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        inputs = [a for a in n.all_input_nodes if _val_dtype(a) is not None]
        if any(_val_dtype(a) in (torch.bfloat16, torch.float16) for a in inputs):
            found.append(n)
        todo += [a for a in inputs if _val_dtype(a) is torch.float32]
    return min(found, key=order.__getitem__, default=None)


def _describe(node: torch.fx.Node) -> str:
    """``aten.linear.default in module blocks.0.q (Linear) at model.py:40 `code`: float32 x bfloat16
    (the float32 value from aten.add.Tensor in module ... at model.py:12 `x = x + self.pe`)``."""
    site = source_line(node)
    kinds = " x ".join(str(d).removeprefix("torch.") for d in _operand_dtypes(node))
    start = origin(node)
    came = "" if start is None else (f" (the float32 value from {start.target}{_module_of(start)}"
                                     f"{f' at {source_line(start)}' if source_line(start) else ''})")
    return f"{node.target}{_module_of(node)}{f' at {site}' if site else ''}: {kinds}{came}"


MIXED_REMEDY = 'cast that value to the activations\' dtype in the model (e.g. `.to(x.dtype)`), or plan with "fp32"'
"""What to do about a :func:`mixed_ops` refusal."""


def mixed_problem(mixed: list[torch.fx.Node], dtype: str, path: str) -> str:
    """The refusal of a ``dtype`` plan, at JSON ``path``, whose trace in ``dtype`` has ``mixed`` ops
    (:func:`mixed_ops`)."""
    described = list(dict.fromkeys(_describe(n) for n in mixed))  # one line per place, not per call
    shown = "; ".join(described[:2]) + (f"; and {len(described) - 2} more" if len(described) > 2 else "")
    shown += f" ({len(mixed)} ops in all)" if len(mixed) > 1 else ""
    return (f'{path}: "{dtype}" cannot run this model: traced as its ranks run it ({dtype} parameters, buffers '
            f"and upcasts as the code makes them), op {shown}: a float32 value (a buffer, or a value cast up "
            f"and never cast back) meets a {dtype} value in an op whose kernel takes one dtype (eager PyTorch "
            f'raises there, e.g. "mat1 and mat2 must have the same dtype"). What to do: {MIXED_REMEDY}')
