"""Expert parallelism as a graph rewrite: MoE experts split over the ``ep`` axis, tokens moved by all-to-all.

Usage::

    from passes.ep.shard_experts import shard_experts_pass
    plan.mesh.dp, plan.mesh.ep = 4, 4          # experts split over groups of ep consecutive dp ranks
    rank_gm = shard_experts_pass(stage_gm, plan, ep_index=dp_index % 4, ep_size=4)
    print(rank_gm.code)                        # moe_dispatch(...) ... grouped_mm ... moe_combine(...)

The ``ep`` axis lives inside the dp axis (GShard, Lepikhin et al. 2020; Megatron-Core's expert model
parallelism): every dp rank routes its own tokens, and the ranks of one ep group each hold ``E/ep``
of the experts. Per MoE layer the pass

* slices every expert weight (``[E, ...]`` on dim 0) to this rank's ``E/ep`` experts and records a
  :class:`~passes.layout.TensorShard` on ``axis`` (so state dicts gather them back);
* sends the expert-sorted token rows to the experts' owners before the expert computation
  (``ep_ops.moe_dispatch``: all-gather of per-expert counts, all-to-all of rows) and brings the
  results back after it (``ep_ops.moe_combine``: all-to-all). Routing, the weighting by router
  probabilities and the sum over the top-k experts stay where they were, on the tokens' own rank.

What it recognises: the grouped form of Hugging Face's experts (``transformers::grouped_mm_fallback``,
what ``@use_experts_implementation`` models such as Mixtral, Qwen-MoE and OLMoE trace to). The
**expert body** is everything from the rows entering the first grouped matmul to the output of the
last one; it must be row-wise (each output row depends only on the same input row and its expert's
weights), because after dispatch it runs on other ranks' rows. A body node that reads anything else
(a per-row bias gathered by expert id, a mask over all rows) raises :class:`ExpertParallelError`
naming it.

Gradients: an expert weight's gradient comes back summed over the tokens of the whole ep group. The
data-parallel pass averages it over the ranks holding the same experts (the ``ep_rep`` axis, dp/ep
ranks) and scales it by 1/ep, which together give the dp mean every other weight gets.

node.meta read: ``fs_module``, ``fs_param``, ``val``. Written on the returned graph: ``val`` of the
sliced weights (local shapes) and of the dispatch outputs (the rows keep the local row count: after
dispatch it is data-dependent, and equal to it when routing is balanced), ``fs_ep`` on the inserted
calls (the layer's module path), with ``fs_module``/``fs_layer`` of the experts they serve. gm.meta: ``fs_layout`` (expert shards), ``fs_ep_summary`` (a summary).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx import Node

from passes.ops import ep_ops
from passes.graph_utils import clone_graph_module, local_fake
from passes.layout import META_LAYOUT, ParamLayout, TensorShard, layout_of
from planner.graph import GROUPED_MM, GROUPED_MMS, META_LAYER, META_MODULE, META_PARAM
from planner.plan import Plan

__all__ = ["shard_experts_pass", "find_expert_layers", "ExpertLayer", "ExpertParallelError", "GROUPED_MM",
           "META_EP", "META_EP_SUMMARY"]

META_EP = "fs_ep"
"""str on the inserted dispatch and combine calls: the module path of the expert layer they serve."""
META_EP_SUMMARY = "fs_ep_summary"
"""gm.meta key: ``{"ep_size", "ep_index", "axis", "layers", "sliced"}`` of the rewritten graph."""

aten = torch.ops.aten
# ops allowed in an expert body: each output row is a function of the same rows of its inputs
_ROWWISE = {aten.silu.default, aten.gelu.default, aten.relu.default, aten.sigmoid.default, aten.tanh.default,
            aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.neg.default,
            aten.clamp.default, aten.pow.Tensor_Scalar, aten.to.dtype, aten._to_copy.default, aten.alias.default,
            aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.contiguous.default,
            aten.clone.default, operator.getitem}
_SPLITS = {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default}
# metadata checks export leaves on values (dtype, device, layout: unchanged by the rewrite)
_CHECKS = {aten._assert_tensor_metadata.default}
# ops allowed between an expert weight and its grouped matmul
_WEIGHT_OPS = {aten.transpose.int, aten.t.default, aten.permute.default, aten.to.dtype, aten._to_copy.default,
               aten.alias.default, aten.contiguous.default, aten.view.default, aten.reshape.default}


class ExpertParallelError(ValueError):
    """The expert-parallel pass cannot split a layer correctly; the message names the node."""


@dataclass
class ExpertLayer:
    """One MoE layer's expert computation in a graph."""

    module: str
    """Module path of the experts (``fs_module`` of the grouped matmuls)."""
    num_experts: int
    offsets: Node
    """``[E]`` running end row of each expert (shared by the layer's grouped matmuls)."""
    entry: Node
    """The expert-sorted token rows entering the first grouped matmul."""
    exit: Node
    """The last grouped matmul (its output leaves the body)."""
    body: list[Node] = field(default_factory=list)
    """Nodes from the entry (exclusive) to the exit (inclusive), in graph order."""
    weights: list[Node] = field(default_factory=list)
    """get_attr nodes of the expert weights ``[E, ...]``."""
    weight_ops: list[Node] = field(default_factory=list)
    """Nodes between a weight and its grouped matmul (transposes, casts)."""


def _fmt(node: Node) -> str:
    return node.format_node() or node.name


def _arg_node(node: Node, i: int) -> Node:
    """``node.args[i]``, which must be a graph value (a grouped matmul's rows or weight)."""
    arg = node.args[i]
    if not isinstance(arg, Node):
        raise ExpertParallelError(f"{_fmt(node)}: argument {i} is {arg!r}, not a tensor of the graph")
    return arg


def _weight_source(node: Node, chain: list[Node]) -> Node:
    """The get_attr a grouped matmul's weight argument comes from, collecting the ops between."""
    while node.op != "get_attr":
        if node.op != "call_function" or node.target not in _WEIGHT_OPS:
            raise ExpertParallelError(f"expert weight {_fmt(node)}: only transposes, views and casts of a "
                                      "parameter may sit between an expert weight and its grouped matmul")
        chain.append(node)
        node = node.all_input_nodes[0]
    return node


def find_expert_layers(gm: torch.fx.GraphModule) -> list[ExpertLayer]:
    """The MoE expert computations of ``gm``, each checked to be splittable (see the module docstring)."""
    groups: dict[Node, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target) in GROUPED_MMS:
            groups.setdefault(node.args[2], []).append(node)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [_layer(gm, offsets, mms, order) for offsets, mms in groups.items()]


def _layer(gm: torch.fx.GraphModule, offsets: Node, mms: list[Node], order: dict[Node, int]) -> ExpertLayer:
    module = str(mms[0].meta.get(META_MODULE, ""))
    val = offsets.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 1:
        raise ExpertParallelError(f"{_fmt(offsets)}: grouped-matmul offsets need a 1-D 'val' (run planner.capture)")
    experts = int(val.shape[0])
    # the body: descendants of the first matmul's rows that lead to the last matmul
    mm_set = set(mms)
    entries = {_arg_node(mm, 0) for mm in mms if not _reaches_from(_arg_node(mm, 0), mm_set)}
    if len(entries) != 1:
        raise ExpertParallelError(f"experts of {module or _fmt(mms[0])}: the grouped matmuls read {len(entries)} "
                                  "different row inputs; expert parallelism needs one token-rows input")
    entry = next(iter(entries))
    exits = [mm for mm in mms if not any(_reaches_from(u, {mm}) for u in mms if u is not mm)]
    if len(exits) != 1:
        raise ExpertParallelError(f"experts of {module or _fmt(mms[0])}: {len(exits)} grouped matmuls end the "
                                  "expert computation; expert parallelism needs a single last one")
    exit_ = exits[0]
    body = sorted(_between(entry, exit_), key=order.__getitem__)
    layer = ExpertLayer(module=module, num_experts=experts, offsets=offsets, entry=entry, exit=exit_, body=body)
    inside = set(body)
    for mm in mms:
        if mm not in inside:
            raise ExpertParallelError(f"{_fmt(mm)} is not on the path from the expert rows to the last grouped "
                                      "matmul; expert parallelism needs one chain of grouped matmuls")
        chain: list[Node] = []
        weight = _weight_source(_arg_node(mm, 1), chain)
        if weight not in layer.weights:
            layer.weights.append(weight)
        layer.weight_ops.extend(c for c in chain if c not in layer.weight_ops)
    allowed = inside | {entry, offsets} | set(layer.weights) | set(layer.weight_ops)
    for node in body:
        if node.op != "call_function" or (str(node.target) not in GROUPED_MMS and node.target not in _ROWWISE):
            raise ExpertParallelError(f"{_fmt(node)} in the experts of {module!r} is not a row-wise op; expert "
                                      "parallelism runs the expert body on other ranks' rows and supports "
                                      "grouped matmuls, activations, elementwise ops, casts and last-dim splits")
        if node.target in _SPLITS and not _last_dim(node):
            raise ExpertParallelError(f"{_fmt(node)} in the experts of {module!r} splits along a dim other than "
                                      "the last; after dispatch the rows are other ranks', so only feature-dim "
                                      "splits are row-wise")
        for arg in node.all_input_nodes:
            if arg not in allowed:
                raise ExpertParallelError(f"{_fmt(node)} in the experts of {module!r} reads {arg.name}, which is "
                                          "neither the expert rows nor an expert weight; it is not available on "
                                          "the rank the rows are dispatched to")
        if node is not exit_ and any(u not in inside and u.target not in _CHECKS for u in node.users):
            raise ExpertParallelError(f"{_fmt(node)} inside the experts of {module!r} is used outside them; "
                                      "only the last grouped matmul's output may leave the expert body")
    for w in layer.weights:
        shape = tuple(gm.get_parameter(str(w.target)).shape) if _is_param(gm, w) else ()
        if not shape or shape[0] != experts:
            raise ExpertParallelError(f"{_fmt(w)}: an expert weight must have the {experts} experts on dim 0, "
                                      f"got shape {shape}")
        stray = [u for u in w.users if u not in inside and u not in layer.weight_ops]
        if stray:
            raise ExpertParallelError(f"expert weight {w.target} is also used by {_fmt(stray[0])}, outside the "
                                      "expert body; a split weight cannot serve it")
    return layer


def _last_dim(node: Node) -> bool:
    """Whether a chunk/split node cuts its input's last dim."""
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    val = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
    ndim = val.dim() if isinstance(val, torch.Tensor) else None
    return bool(dim == -1 or (ndim is not None and dim == ndim - 1))


def _is_param(gm: torch.fx.GraphModule, node: Node) -> bool:
    try:
        gm.get_parameter(str(node.target))
    except AttributeError:
        return False
    return True


def _reaches_from(node: object, sources: set[Node]) -> bool:
    """Whether ``node`` is (a descendant of) one of ``sources``."""
    if not isinstance(node, Node):
        return False
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in sources:
            return True
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return False


def _between(entry: Node, exit_: Node) -> set[Node]:
    """Nodes that depend on ``entry`` and that ``exit_`` depends on (``exit_`` included)."""
    ancestors, todo = set(), [exit_]
    while todo:
        n = todo.pop()
        if n in ancestors or n is entry:
            continue
        ancestors.add(n)
        todo.extend(n.all_input_nodes)
    return {n for n in ancestors if _reaches_from(n, {entry})}


def shard_experts_pass(gm: torch.fx.GraphModule, plan: Plan | None = None, *, ep_index: int, ep_size: int,
                       axis: str = "ep") -> torch.fx.GraphModule:
    """Rewrite ``gm`` into the graph of rank ``ep_index`` of an ``ep_size`` expert-parallel group
    (see the module docstring). ``gm`` is left intact; with ``ep_size == 1`` it is returned as is."""
    if plan is not None and plan.mesh.ep != ep_size:
        raise ExpertParallelError(f"plan.mesh.ep is {plan.mesh.ep} but ep_size={ep_size} was given")
    if not 0 <= ep_index < ep_size:
        raise ExpertParallelError(f"ep_index={ep_index} is outside [0, {ep_size})")
    if ep_size == 1:
        return gm
    out = clone_graph_module(gm)
    layers = find_expert_layers(out)
    if not layers:
        raise ExpertParallelError(f"mesh.ep = {ep_size} but this graph has no mixture-of-experts layer "
                                  f"({GROUPED_MM} calls); set mesh.ep to 1")
    old = layout_of(gm)
    layout = ParamLayout(keys=dict(old.keys), tp=dict(old.tp), flat=dict(old.flat))
    graph = out.graph
    sliced: dict[str, str] = {}
    for layer in layers:
        if layer.num_experts % ep_size:
            raise ExpertParallelError(f"mesh.ep = {ep_size} does not divide the {layer.num_experts} experts of "
                                      f"{layer.module!r}; choose an ep that divides {layer.num_experts}")
        _slice_weights(out, layer, layout, ep_index=ep_index, ep_size=ep_size, axis=axis, sliced=sliced)
        _insert_dispatch(graph, layer, axis=axis, ep_size=ep_size)
    graph.lint()
    out.recompile()
    out.meta[META_LAYOUT] = layout
    out.meta[META_EP_SUMMARY] = {"ep_size": ep_size, "ep_index": ep_index, "axis": axis,
                         "layers": [layer.module for layer in layers], "sliced": sliced}
    return out


def _slice_weights(gm: torch.fx.GraphModule, layer: ExpertLayer, layout: ParamLayout, *, ep_index: int,
                   ep_size: int, axis: str, sliced: dict[str, str]) -> None:
    for w in layer.weights:
        target = str(w.target)
        full = gm.get_parameter(target)
        key = layout.keys.get(target) or w.meta.get(META_PARAM) or target
        if key in layout.tp:
            raise ExpertParallelError(f"expert weight {key} is already split by tensor parallelism "
                                      f"({layout.tp[key]}); use the 'replicate' style for experts when mesh.ep > 1")
        if key not in sliced:
            shard = TensorShard(key=key, global_shape=tuple(full.shape), dim=0, index=ep_index, count=ep_size,
                                axis=axis)
            local = torch.nn.Parameter(shard.slice(full.detach()), requires_grad=full.requires_grad)
            owner, _, name = target.rpartition(".")
            setattr(gm.get_submodule(owner) if owner else gm, name, local)
            layout.tp[key] = shard
            layout.keys.setdefault(target, key)
            sliced[key] = f"S(0)/{axis}"
        _set_local_val(w, gm.get_parameter(target).shape)
    for op in layer.weight_ops:  # transposes of a weight: same dims, E/ep experts
        val = op.meta.get("val")
        if isinstance(val, torch.Tensor):
            src = op.all_input_nodes[0].meta["val"]
            _set_local_val(op, [src.shape[0] if d == 0 else s for d, s in enumerate(val.shape)])


def _set_local_val(node: Node, shape: object) -> None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        node.meta["val"] = local_fake(val, shape)  # type: ignore[arg-type]


def _insert_dispatch(graph: torch.fx.Graph, layer: ExpertLayer, *, axis: str, ep_size: int) -> None:
    first = layer.body[0]
    with graph.inserting_before(first):
        call = graph.call_function(ep_ops.moe_dispatch, (layer.entry, layer.offsets, axis, layer.num_experts))
        rows = graph.call_function(operator.getitem, (call, 0))
        offs = graph.call_function(operator.getitem, (call, 1))
        route = graph.call_function(operator.getitem, (call, 2))
    entry_val, offs_val = layer.entry.meta.get("val"), layer.offsets.meta.get("val")
    tags = {k: layer.exit.meta[k] for k in (META_MODULE, META_LAYER) if k in layer.exit.meta}
    for node in (call, rows, offs, route):
        node.meta.update(tags)
        node.meta[META_EP] = layer.module
    if isinstance(entry_val, torch.Tensor):
        rows.meta["val"] = entry_val
    if isinstance(offs_val, torch.Tensor):
        offs.meta["val"] = offs_val
        _set_local_val(offs, (layer.num_experts // ep_size,))
    for node in layer.body:
        node.args = torch.fx.node.map_arg(node.args, lambda a: rows if a is layer.entry else
                                          offs if a is layer.offsets else a)
    with graph.inserting_after(layer.exit):
        back = graph.call_function(ep_ops.moe_combine, (layer.exit, route, axis))
    back.meta.update(tags)
    back.meta[META_EP] = layer.module
    if "val" in layer.exit.meta:
        back.meta["val"] = layer.exit.meta["val"]
    layer.exit.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
