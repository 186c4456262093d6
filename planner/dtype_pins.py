"""Where a model's code pins values to float32: what an fp32 trace of it cannot run in bf16.

The planning capture runs the model in fp32. There, a ``.to(torch.float32)``, ``.float()`` or
``.to(x.dtype)`` is a no-op that leaves only export's ``_assert_tensor_metadata(dtype=torch.float32)``
in the graph, and a cast from integers (``position_ids.float()``) is a real cast to fp32. Run with
bf16 parameters such a graph would compute Hugging Face's RMSNorm variance in bf16 where the model
computes it in fp32, or mix fp32 values into bf16 matmuls. So the graphs ranks compile for a bf16
or fp16 plan are traced in that dtype (:mod:`planner.trace_dtype`), and the mixed-precision pass
(``passes.dp.graph.cast_io``) refuses a graph traced in fp32 that has pins, naming their lines.

A graph traced in the plan's dtype can hold the opposite mistake, the model's own: a float32
buffer (a sinusoidal position table, a relative-position bias) or an upcast that is never cast
back meets a bf16 parameter in a matmul. Eager PyTorch refuses that ("mat1 and mat2 must have the
same dtype"); torch.export's fake kernels do not check it, so the trace records it and the ranks
would crash at their first step. :func:`mixed_matmuls` finds those nodes, and the mixed-precision
pass refuses the plan before launch with :func:`mixed_problem`, naming module, op and line.

Usage::

    pins = fp32_pins(graph)     # ["hidden_states.to(torch.float32) (modeling_llama.py:62 `...`)", ...]
    mixed = mixed_matmuls(gm)   # [linear node, ...]; mixed_problem(mixed, "bf16", path) says where and what to do
"""

from __future__ import annotations

import torch
import torch.fx

from planner.batch_stats import source_line
from planner.graph import META_MODULE, ModelGraph

__all__ = ["fp32_pins", "module_pins", "pins_problem", "mixed_matmuls", "mixed_problem", "MIXED_REMEDY",
           "PINS_REMEDY"]

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


_MATMULS = frozenset({"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "einsum", "mv", "addmv", "dot",
                      "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d",
                      "conv_transpose2d", "conv_transpose3d", "scaled_dot_product_attention"})
"""ATen ops (by name, any overload) whose kernels refuse floating operands of different dtypes."""


def _dtypes(arg: object) -> list[torch.dtype]:
    if isinstance(arg, (list, tuple)):
        return [d for a in arg for d in _dtypes(a)]
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return [val.dtype] if isinstance(val, torch.Tensor) and val.is_floating_point() else []


def _module_of(node: torch.fx.Node) -> str:
    """`` in module PATH (Class)``: the path the capture recorded (``META_MODULE``, normalized there),
    the class from export's ``nn_module_stack``; '' for a node outside every module's call."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    cls = next(reversed(stack.values()))[1]
    name = cls.__name__ if isinstance(cls, type) else str(cls).rpartition(".")[2]
    return f" in module {node.meta.get(META_MODULE) or '(top)'} ({name})"


def mixed_matmuls(gm: torch.nn.Module) -> list[torch.fx.Node]:
    """The matmuls and convolutions of ``gm`` (nested graphs included) whose floating operands
    differ in dtype, in graph order."""
    found = []
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            name = getattr(node.target, "__name__", "").split(".")[0] if node.op == "call_function" else ""
            if name in _MATMULS and len(set(_operand_dtypes(node))) > 1:
                found.append(node)
    return found


def _operand_dtypes(node: torch.fx.Node) -> list[torch.dtype]:
    """The dtypes the op needs to agree: every floating operand, but of attention only query, key
    and value (its kernels take a float mask of another dtype)."""
    args = node.args[:3] if "scaled_dot_product_attention" in str(node.target) else (*node.args, *node.kwargs.values())
    return list(dict.fromkeys(d for a in args for d in _dtypes(a)))


def _val_dtype(node: object) -> torch.dtype | None:
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
"""What to do about a :func:`mixed_matmuls` refusal."""


def mixed_problem(mixed: list[torch.fx.Node], dtype: str, path: str) -> str:
    """The refusal of a ``dtype`` plan, at JSON ``path``, whose trace in ``dtype`` has ``mixed`` matmuls."""
    described = list(dict.fromkeys(_describe(n) for n in mixed))  # one line per place, not per call
    shown = "; ".join(described[:2]) + (f"; and {len(described) - 2} more" if len(described) > 2 else "")
    shown += f" ({len(mixed)} ops in all)" if len(mixed) > 1 else ""
    return (f'{path}: "{dtype}" cannot run this model: traced as its ranks run it ({dtype} parameters, buffers '
            f"and upcasts as the code makes them), op {shown}: a float32 value (a buffer, or a value cast up "
            f"and never cast back) meets a {dtype} parameter, which the kernel refuses (eager PyTorch raises "
            f'"mat1 and mat2 must have the same dtype" there). What to do: {MIXED_REMEDY}')
