"""Graph helpers shared by the data-parallel rewrites: parameter discovery, node order, rebuilding
a GraphModule that owns fresh tensors, and input/output dtype casts for mixed precision."""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from passes.ops import dp_ops
from planner.dtype_pins import MIXED_REMEDY, PINS_REMEDY, mixed_ops, mixed_problem, module_pins, pins_problem
from planner.trace_dtype import traced_dtype
from passes.dp.info import DataParallelInfo, Placement
from passes.layout import META_LAYOUT, ParamLayout, layout_of
from planner.buffer_writes import written_attrs
from planner.graph import META_PARAM
from planner.modpath import fetch_attr, install_attr

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ParamUse:
    """One parameter of the graph and the get_attr nodes that read it."""

    attr: str
    """Attribute path in the source GraphModule (the first one, if several alias it)."""
    key: str
    """The user's state_dict key."""
    tensor: nn.Parameter
    nodes: list[torch.fx.Node] = field(default_factory=list)
    first_use: int = 0
    """Position (in graph order) of the first node that reads the parameter."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Other attrs holding the same tensor (tied parameters) -> their user keys."""


def dtype_of(name: str, what: str) -> torch.dtype | None:
    """The low-precision dtype named, or None for ``fp32``: full precision, i.e. the model's own
    dtype (fp32, or fp64 for a double-precision model)."""
    if name not in DTYPES:
        raise ValueError(f"data_parallel.{what} = {name!r}; choose one of {sorted(DTYPES)}")
    return None if name == "fp32" else DTYPES[name]


def common_dtype(tensors: list[torch.Tensor], what: str) -> torch.dtype:
    dtypes = sorted({str(t.dtype) for t in tensors})
    if len(dtypes) != 1:
        raise ValueError(f"{what} mixes parameter dtypes {dtypes}; flat shards need one dtype: give those "
                         "parameters their own units (data_parallel.units) or cast the model to one dtype")
    return tensors[0].dtype


def positions(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def find_params(gm: torch.fx.GraphModule, graph: torch.fx.Graph, layout: ParamLayout) -> list[ParamUse]:
    """Parameters read by ``graph`` (nodes of the copy), grouped by tensor identity (tied
    parameters are one entry), ordered by first use."""
    pos = positions(graph)
    by_id: dict[int, ParamUse] = {}
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        obj = fetch_attr(gm, str(node.target))
        if not isinstance(obj, nn.Parameter):
            continue
        use = by_id.get(id(obj))
        key = layout.keys.get(str(node.target), node.meta.get(META_PARAM, str(node.target)))
        if use is None:
            use = by_id[id(obj)] = ParamUse(attr=str(node.target), key=key, tensor=obj)
        elif str(node.target) != use.attr:
            use.aliases[str(node.target)] = key
        use.nodes.append(node)
    out = []
    for use in by_id.values():
        users = [u for n in use.nodes for u in n.users]
        if not users:
            continue  # read by nothing: no gradient, nothing to sync
        use.first_use = min(pos[u] for u in users)
        out.append(use)
    out.sort(key=lambda u: u.first_use)
    return out


def placement(device: torch.device | str | None, *, offload: bool, tensors: list[torch.Tensor]) -> Placement:
    """The placement for ``device`` (default: where the graph's parameters are; ``cpu`` for a
    ``meta`` capture), with the store on the host when ``offload``."""
    if device is None:
        device = next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))
    compute = torch.device(device)
    if compute.type == "cuda" and compute.index is None:
        compute = torch.device("cuda", torch.cuda.current_device())
    cpu = torch.device("cpu")
    return Placement(compute=compute, store=cpu if offload else compute, pin=offload and compute.type == "cuda")


def real_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A detached copy on ``device``; for a ``meta`` tensor, uninitialized storage of its shape
    there (filled later by ``fairscale.runtime.init.materialize_sharded``)."""
    if t.is_meta:
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    return t.detach().to(device, copy=True)


def fill_shard(shard: torch.Tensor, tensors: list[torch.Tensor], lo: int) -> None:
    """Copy elements ``[lo, lo + shard.numel())`` of the concatenation of ``tensors`` into ``shard``."""
    hi = lo + shard.numel()
    start = 0
    for t in tensors:
        n = t.numel()
        a, b = max(start, lo), min(start + n, hi)
        if a < b:
            shard[a - lo:b - lo] = t.reshape(-1)[a - start:b - start].to(shard.dtype)
        start += n


def place_graph(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """Move ``gm`` to ``device`` in place: every buffer (and constant registered as one) not on it
    yet, and every ``device`` argument the capture baked into graph nodes (``arange(...,
    device=cpu)``, ``_to_copy(..., device=cpu)``, ``_assert_tensor_metadata``), so tensors the
    graph creates at run time land on ``device`` too. Parameters are left where the pass put them
    (an offloaded store stays on the host)."""
    for name, buf in list(gm.named_buffers()):
        if buf.device != device and not buf.is_meta:
            *prefix, attr = name.split(".")
            owner = fetch_attr(gm, ".".join(prefix)) if prefix else gm
            assert isinstance(owner, nn.Module)
            owner.register_buffer(attr, buf.to(device), persistent=attr not in owner._non_persistent_buffers_set)

    def move(a: Any) -> Any:
        return device if isinstance(a, torch.device) and a != device else a

    # nested graphs too: the bodies of higher-order ops (wrap_with_set_grad_enabled, autocast regions)
    for sub in [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]:
        changed = False
        for node in sub.graph.nodes:
            if node.op not in ("call_function", "call_method"):
                continue
            args = torch.fx.node.map_aggregate(node.args, move)
            kwargs = dict(torch.fx.node.map_aggregate(node.kwargs, move))
            if isinstance(kwargs.get("device"), str):  # an fx trace keeps x.to(device="cpu") as written
                kwargs["device"] = device
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs = args, kwargs
                changed = True
        if changed:
            sub.recompile()


def drop_aliases(params: list[ParamUse], layout: ParamLayout) -> dict[str, list[str]]:
    """Tied parameters are one tensor under their first attr: remove the other attrs from the
    layout and return canonical key -> alias keys (state dicts emit every name)."""
    out: dict[str, list[str]] = {}
    for use in params:
        for attr, key in use.aliases.items():
            layout.keys.pop(attr, None)
            if key != use.key:
                out.setdefault(use.key, []).append(key)
    return out


def replace_param_uses(graph: torch.fx.Graph, use: ParamUse, value: torch.fx.Node,
                       keep: set[torch.fx.Node]) -> None:
    """Point every reader of ``use`` (except the nodes in ``keep``) at ``value``."""
    for node in use.nodes:
        node.replace_all_uses_with(value, delete_user_cb=lambda u: u not in keep)


def rebuild(src: torch.fx.GraphModule, graph: torch.fx.Graph, objects: dict[str, object],
            layout: ParamLayout) -> torch.fx.GraphModule:
    """A new GraphModule running ``graph`` whose get_attr targets come from ``objects`` first and
    from ``src`` otherwise (shared, e.g. buffers and constants), but for a buffer the graph writes
    in place (a step counter, an aux-loss-free router's bias under no_grad), which it owns: shared,
    the rank's training had written into the user's model, and a second module compiled from it
    started from those values."""
    written = written_attrs(src)
    root = nn.Module()
    for node in reversed(list(graph.nodes)):  # readers of replaced parameters are gone now
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            target = str(node.target)
            owned = any(target.startswith(k + ".") for k in objects if isinstance(objects[k], nn.Module))
            if target not in objects and not owned:
                value = fetch_attr(src, target)
                objects[target] = value.detach().clone() if target in written and isinstance(value, torch.Tensor) \
                    else value
    for target, obj in objects.items():
        install_attr(root, target, obj)
    out = torch.fx.GraphModule(root, graph, class_name=type(src).__name__)
    out.graph.lint()
    out.meta = copy.copy(src.meta)
    out.meta[META_LAYOUT] = layout
    return out


def keep_frozen(graph: torch.fx.Graph, params: list[ParamUse], info: DataParallelInfo, objects: dict[str, object],
                *, param_dtype: torch.dtype | None, place: Placement) -> list[ParamUse]:
    """Frozen parameters (``requires_grad`` False) stay whole on every rank at the model's own
    precision (what checkpoints save, so a later fp32 plan resumes them exactly); under mixed
    precision each read is cast to ``param_dtype``, as the buckets cast the trainable ones.
    Returns the trainable uses."""
    for use in params:
        if use.tensor.requires_grad:
            continue
        objects[use.attr] = nn.Parameter(real_copy(use.tensor, place.compute), requires_grad=False)
        info.replicated[use.attr] = use.key
        if param_dtype is None or not use.tensor.is_floating_point() or use.tensor.dtype == param_dtype:
            continue
        for node in use.nodes:
            with graph.inserting_after(node):
                cast = graph.call_method("to", (node, param_dtype))
            node.replace_all_uses_with(cast, delete_user_cb=lambda u: u is not cast)
    return [u for u in params if u.tensor.requires_grad]


def fresh_layout(gm: torch.fx.GraphModule) -> ParamLayout:
    src = layout_of(gm)
    return ParamLayout(keys=dict(src.keys), tp=dict(src.tp), flat=dict(src.flat))


def cast_io(graph: torch.fx.Graph, dtype: torch.dtype, source: torch.fx.GraphModule) -> None:
    """Mixed precision: cast floating-point inputs to ``dtype``; cast a scalar output (a loss)
    back to fp32. Pipeline stages that return activations keep them in ``dtype``. A graph traced
    in ``dtype`` (:mod:`planner.trace_dtype`) recorded its batch already cast: each floating input
    is cast to the dtype the trace saw (the user's batch arrives in fp32; a stage's received
    activation already has it, and an fp32 one, an upcast crossing a stage cut, stays fp32).
    ``source`` is the module ``graph`` was copied from (the copy has no owner): its trace's dtype."""
    traced = traced_dtype(source)
    for node in list(graph.nodes):
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if val is None:  # no shape meta (an fx trace without annotation): decide at run time
            with graph.inserting_after(node):
                cast = graph.call_function(dp_ops.cast_floating, (node, dtype))
        elif isinstance(val, torch.Tensor) and val.is_floating_point() and traced == dtype:
            with graph.inserting_after(node):
                cast = graph.call_method("to", (node, val.dtype))
        elif isinstance(val, torch.Tensor) and val.is_floating_point() and val.dtype != dtype:
            with graph.inserting_after(node):
                cast = graph.call_method("to", (node, dtype))
        else:
            continue
        node.replace_all_uses_with(cast, delete_user_cb=lambda u: u is not cast)
    out = next(n for n in graph.nodes if n.op == "output")

    def fp32(res: Any) -> Any:
        if isinstance(res, (tuple, list)):
            return type(res)(fp32(r) for r in res)
        if not isinstance(res, torch.fx.Node):
            return res
        val = res.meta.get("val")
        if val is None:
            with graph.inserting_before(out):
                return graph.call_function(dp_ops.float_scalar, (res,))
        if isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point():
            with graph.inserting_before(out):
                return graph.call_method("float", (res,))
        return res

    out.args = (fp32(out.args[0]),)
    name = next((k for k, v in DTYPES.items() if v == dtype), str(dtype))
    pins = module_pins(source) if traced != dtype else []
    if pins:  # traced in fp32 (not as the ranks trace a mixed-precision plan): refused, before launch
        raise DtypeError(pins_problem(pins, name, "data_parallel.param_dtype"), hint=PINS_REMEDY)
    mixed = mixed_ops(source) if traced == dtype else []
    if mixed:  # the model's own mix of an fp32 value and a bf16 parameter: the ranks would crash at step 1
        raise DtypeError(mixed_problem(mixed, name, "data_parallel.param_dtype"), hint=MIXED_REMEDY, node=mixed[0])


class DtypeError(ValueError):
    """A mixed-precision plan the trace cannot run (``planner.dtype_pins``: an fp32 trace with
    upcasts, or the model's own float32 values meeting a 16-bit matmul): ``hint`` says what to do
    and ``node`` is the first op concerned, if one is (the compile check reports both, not the data-
    parallel pass's generic advice)."""

    def __init__(self, message: str, *, hint: str, node: torch.fx.Node | None = None) -> None:
        super().__init__(message)
        self.hint = hint
        self.node = node


def is_alias_op(node: torch.fx.Node, aliases: set[torch.fx.Node]) -> bool:
    """Whether ``node``'s output may share storage with one of its inputs in ``aliases``."""
    if not any(isinstance(a, torch.fx.Node) and a in aliases for a in node.all_input_nodes):
        return False
    if node.op not in ("call_function", "call_method"):
        return True  # conservative
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is not None:  # aten op: its schema says whether the result aliases an input
        return any(r.alias_info is not None for r in schema.returns)
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name in _VIEW_NAMES  # torch-level call in an fx trace


_VIEW_NAMES = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "t", "permute", "expand", "expand_as", "squeeze",
    "unsqueeze", "flatten", "unflatten", "narrow", "select", "split", "chunk", "unbind", "tensor_split",
    "as_strided", "contiguous", "detach", "movedim", "moveaxis", "swapaxes", "swapdims", "diagonal", "unfold",
    "real", "imag", "T", "mT", "H", "mH", "alias", "__getitem__", "type_as", "to", "float", "half", "bfloat16",
    "clone"})
"""Torch-level calls whose result may share storage with an input (``to``/``float`` return their
input when no conversion is needed; ``clone`` is listed only to stay conservative)."""
