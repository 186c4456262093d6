"""Tensor and sequence parallelism as a rewrite of one rank's graph (Megatron-LM style).

Usage::

    from passes.tp.shard_tensor_parallel import shard_tensor_parallel_pass
    plan.tensor_parallel.rules = {"layers.*.self_attn.[q_proj,k_proj,v_proj]": "colwise",
                                  "layers.*.self_attn.o_proj": "rowwise",
                                  "layers.*.mlp.[gate_proj,up_proj]": "colwise",
                                  "layers.*.mlp.down_proj": "rowwise",
                                  "embed_tokens": "vocab_embedding", "lm_head": "vocab_loss"}
    rank_gm = shard_tensor_parallel_pass(graph.gm, plan, tp_index=r, tp_size=2)
    loss = rank_gm(input_ids, labels)      # same loss on every tp rank; backward gives local grads

Args:
    gm: a captured graph (``planner.capture``) or a pipeline stage of one. Batch inputs are taken
        replicated. On a stage graph (``gm.meta["fs_stage_io"]``, ``passes.split_stages``) with
        sequence parallelism, the activations it receives and sends ([b, t, ...] floats whose t
        divides by tp) travel as their sequence shard S(1), as Megatron-LM sends them; every other
        boundary value, and everything without sequence parallelism, travels whole.
    plan: ``plan.tensor_parallel.rules`` maps module selectors to styles; the first rule whose
        selector matches a node's module applies. ``plan.tensor_parallel.sequence_parallel``.
    tp_index, tp_size: this rank's position on the tp axis and its size (``plan.mesh.tp``).
    axis: the comm axis name the inserted collectives use.

Styles (per module; the module's linear/addmm/mm/matmul/embedding nodes are sharded):

* ``colwise``: weight split on output features; the output stays sharded on its last dim.
  A fused output that is later split into equal blocks (GPT-2 ``c_attn`` q|k|v, gate|up) is
  sharded block by block (``TensorShard.parts``).
* ``colwise_gather``: colwise, then the output is all-gathered.
* ``rowwise``: weight split on input features; the output is a partial sum, reduced where it is
  consumed (all-reduce, or reduce-scatter under sequence parallelism); the bias is added once.
* ``vocab_embedding``: embedding table split on the vocab (masked lookup, then reduction).
* ``vocab_loss``: colwise LM head whose sharded logits must reach ``cross_entropy`` (or
  ``log_softmax`` + ``nll_loss``), which is rewritten to a vocab-parallel cross-entropy.
* ``expert``: MoE expert weights split on the expert dim (``transformers::grouped_mm_fallback``);
  each rank runs the tokens routed to its experts and the combine is reduced.
* ``replicate``: keep the module's parameters whole.

Everything between follows from placement propagation (``passes.tp.rules``): views of heads are
rewritten to local sizes (``view(b, t, h, d)`` -> ``view(b, t, h/tp, d)``), attention runs on the
local heads, and collectives are inserted only where a consumer needs another placement. With
sequence parallelism (Korthikanti et al. 2022) the partial sums become reduce-scatters along the
sequence (dim 1), norm/dropout/residual regions run on sequence shards, and the all-gather in
front of a column-parallel block is ``gather_seq`` (reduce-scatter in backward). A replicated value
that enters the sequence-sharded residual and also feeds a norm in front of a column-parallel block
(a replicated embedding's output, a stage input) is copied once and split by ``tp_ops.local_chunk``,
so its backward needs one all-reduce instead of an all-gather plus an all-reduce
(``passes.tp.fuse``). A node that cannot be sharded correctly raises :class:`TPShardError` quoting
``node.format_node()``.

Dropout with p > 0 on a sharded value draws an independent mask per tp rank
(``tp_ops.sharded_dropout``); replicated dropouts stay identical across tp ranks provided every tp
rank starts from the same RNG seed (the runtime's job). The ``expert`` style combines expert outputs
with the all-reduce (or reduce-scatter) of the block output: the tokens are replicated on the tp
ranks, so each rank already has the rows of its experts and moving them by all-to-all would only add
traffic. Token dispatch by all-to-all is for tokens that differ between ranks, i.e. experts split
over data-parallel ranks: ``mesh.ep`` and :mod:`passes.ep.shard_experts`.

node.meta keys read: ``val`` (shapes), ``fs_module`` (rule matching), ``fs_param`` (user keys).
node.meta keys written (on the returned graph): ``fs_tp`` (placement of every value: ``R``,
``S(d)``, ``P``), ``fs_tp_comm`` (on inserted collectives: why), ``fs_tp_style`` (the style that
applied to a node), ``fs_tp_fallback`` (ops run replicated for lack of a rule), ``val`` (rank-local
fake tensor) and ``fs_tp_global_shape``. gm.meta read: ``fs_stage_io``. gm.meta written: ``fs_layout`` (a
:class:`~passes.layout.ParamLayout` with a ``TensorShard`` per sliced parameter) and ``fs_tp_summary``
(:mod:`passes.tp.summary`: sizes, sharded keys, inserted collectives by kind, and ``received`` / ``sent``: the
placement and rank-local shape of each received placeholder and each sent output, which the
pipeline runtime uses for its p2p buffers).
"""

from __future__ import annotations

import copy
import inspect
from collections import Counter
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from passes.ops.calls import calls_of
from passes.layout import META_LAYOUT, ParamLayout, TensorShard
from passes.tp.functionalize import functionalize_inplace
from passes.tp.normalize import to_aten
from passes.tp.fuse import fuse_gather_copy, hoist_copy_over_scatter
from passes.split_stages import stage_io
from passes.tp.placement import Placement, R, S, local_shape
from passes.tp.summary import META_TP_SUMMARY
from passes.tp.rewrite import META_TP, Rewriter, TPShardError, args_of, fmt, source_of
from passes.tp.model_rules import rule_for
from passes.tp.rules import NOT_OUTPUT, VIEWS
from passes.tp.rules_matmul import WEIGHT_OPS
from planner.graph import META_MODULE, META_PARAM
from planner.plan import Plan
from planner.selectors import parse_selector
from planner.tp_styles import STYLES, TP_STYLES, split_dim

__all__ = ["shard_tensor_parallel_pass", "check_tensor_parallel", "TPShardError", "COLLECTIVES", "collective_counts"]

aten = torch.ops.aten
META_STYLE = "fs_tp_style"

COLLECTIVES = calls_of("tp", collective=True)
"""Autograd-paired collective functions the pass inserts, by name."""

_PASSTHROUGH = VIEWS | {aten.to.dtype, aten.to.dtype_layout, aten.alias.default, aten._to_copy.default}


def collective_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    """How many of each tp collective (and vocab-parallel loss) a rank graph calls."""
    named = calls_of("tp")
    counts: Counter[str] = Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in named:
            counts[named[node.target]] += 1
    return dict(counts)


def shard_tensor_parallel_pass(gm: torch.fx.GraphModule, plan: Plan, *, tp_index: int, tp_size: int,
                               axis: str = "tp", seq_dim: int = 1) -> torch.fx.GraphModule:
    """Rewrite ``gm`` into the graph of tp rank ``tp_index`` of ``tp_size`` (see the module docstring)."""
    gm, rw, params, sp, boundary = _rewrite(gm, plan, tp_index=tp_index, tp_size=tp_size, axis=axis, seq_dim=seq_dim)
    fuse_gather_copy(rw.graph)
    hoist_copy_over_scatter(rw.graph, gm)
    if tp_size > 1:
        _views_as_reshapes(rw.graph)
    rw.graph.lint()
    out = _build_module(gm, rw, params, tp_index=tp_index, tp_size=tp_size, axis=axis, sp=sp)
    out.meta[META_TP_SUMMARY].update(boundary)
    return out


def check_tensor_parallel(gm: torch.fx.GraphModule, plan: Plan, *, tp_size: int, seq_dim: int = 1) -> None:
    """Raise :class:`TPShardError` where :func:`shard_tensor_parallel_pass` would (rank 0's rewrite;
    no module is built): what the pattern detector runs to check its proposals."""
    _rewrite(gm, plan, tp_index=0, tp_size=tp_size, axis="tp", seq_dim=seq_dim)


def _rewrite(gm: torch.fx.GraphModule, plan: Plan, *, tp_index: int, tp_size: int, axis: str,
             seq_dim: int) -> tuple[torch.fx.GraphModule, Rewriter, dict[str, Placement], bool, dict[str, Any]]:
    if plan.mesh.tp != tp_size:
        raise TPShardError(f"plan.mesh.tp is {plan.mesh.tp} but tp_size={tp_size} was given")
    if not 0 <= tp_index < tp_size:
        raise TPShardError(f"tp_index={tp_index} is outside [0, {tp_size})")
    tpp = plan.tensor_parallel
    rules = []
    for text, style in tpp.rules.items():
        if style not in TP_STYLES:
            raise TPShardError(f"tensor_parallel rule {text!r}: unknown style {style!r}; choose from {TP_STYLES}")
        rules.append((text, parse_selector(text), style))
    if tp_size == 1:
        rules, sp = [], False
    else:
        sp = tpp.sequence_parallel
        gm = functionalize_inplace(to_aten(gm))  # fx-captured graphs in ATen form; out += x as out = out + x
    params, styles = _plan_params(gm, rules, tp_size)
    rw = Rewriter(gm, tp=tp_size, index=tp_index, axis=axis, sequence_parallel=sp, seq_dim=seq_dim,
                  params=params, styles=styles)
    rw.graph._codegen = copy.deepcopy(gm.graph._codegen)
    io = stage_io(gm)
    received = set(io.received) if io is not None else set()
    sends = io is not None and io.sends
    boundary: dict[str, list[tuple[str, tuple[int, ...]]]] = {"received": [], "sent": []}
    for node in gm.graph.nodes:
        rw.cur = node
        rw.grad[node] = rw.compute_grad(node)
        if node.op == "placeholder":
            new = rw.graph.placeholder(str(node.target), type_expr=node.type,
                                       default_value=args_of(node)[0] if node.args else inspect.Signature.empty)
            new.meta = dict(node.meta)
            place: Any = None
            if rw.is_tensor(node):
                place = rw.boundary_place(node) if str(node.target) in received else R
                if place.is_s:
                    rw.set_local_val(new, node, place)
            if str(node.target) in received:
                boundary["received"].append(_io_record(rw, node, place))
        elif node.op == "get_attr":
            new = rw.graph.get_attr(str(node.target))
            new.meta = dict(node.meta)
            place = params.get(str(node.target), R) if rw.is_tensor(node) else None
            if isinstance(place, Placement) and place.is_s:
                rw.set_local_val(new, node, place)
        elif node.op == "call_function":
            try:
                new, place = rule_for(node.target)(rw, node)
            except TPShardError as exc:
                exc.node = getattr(exc, "node", None) or node  # for the pattern detector's retries
                raise
            except Exception as exc:  # a rule that breaks on an op it does not expect refuses, never crashes
                raise _at(node, TPShardError(
                    f"the tensor-parallel rule for {node.target} failed on {fmt(node)}{source_of(node)}: "
                    f"{type(exc).__name__}: {exc}; replicate this module (rule 'replicate') or report it")) from exc
        elif node.op == "output":
            want = {a: rw.boundary_place(a) if sends else R for a in node.all_input_nodes if rw.is_tensor(a)}
            rw.graph.output(rw.map_args(args_of(node)[0], want, R), type_expr=node.type)
            if sends:
                outs = args_of(node)[0]
                for a in outs if isinstance(outs, (tuple, list)) else [outs]:
                    boundary["sent"].append(_io_record(rw, a, want.get(a)))
            continue
        elif node.op == "call_module":  # a leaf module fx could not trace into: runs whole on every rank
            want = {a: R for a in rw.tensor_inputs(node)}
            new = rw.graph.call_module(str(node.target), rw.map_args(node.args, want, R), rw.map_args(node.kwargs, want, R))
            new.meta = {k: v for k, v in node.meta.items()}
            place = R if rw.is_tensor(node) else None
        else:
            raise TPShardError(f"{fmt(node)}: {node.op} nodes are not supported; capture with planner.capture")
        if isinstance(place, Placement):
            new.meta[META_TP] = str(place)
        if node in styles:
            new.meta[META_STYLE] = styles[node]
        rw.env[node], rw.place[node] = new, place
    return gm, rw, params, sp, boundary


def _io_record(rw: Rewriter, node: Any, place: Any) -> tuple[str, tuple[int, ...]]:
    """(placement, rank-local shape) of a value crossing a stage boundary."""
    if not (isinstance(node, Node) and rw.is_tensor(node)):
        return ("-", ())
    return (str(place), tuple(local_shape(rw.shape(node), place, rw.tp)))


# ------------------------------------------------------------------------------------------ parameters


def _plan_params(gm: torch.fx.GraphModule, rules: list[tuple[str, Any, str]],
                 tp: int) -> tuple[dict[str, Placement], dict[Node, str]]:
    """Placement of every parameter the rules shard, and the style of every matched node."""
    claims: dict[str, list[tuple[Placement, Node, str]]] = {}
    styles: dict[Node, str] = {}
    matched_without_param: dict[str, Node] = {}
    used_rules: set[str] = set()
    # tied parameters are one tensor under several attribute names: they share one placement
    canonical: dict[str, str] = {}
    aliases: dict[int, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and META_PARAM in node.meta:
            group = aliases.setdefault(id(_attr(gm, str(node.target))), [])
            if str(node.target) not in group:
                group.append(str(node.target))
    for group in aliases.values():
        for target in group:
            canonical[target] = group[0]
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        path = node.meta.get(META_MODULE, "")
        hit = next(((text, style) for text, sel, style in rules if path and sel.matches(path)), None)
        if hit is None:
            continue
        text, style = hit
        styles[node] = style
        try:
            node_claims = _claims_of(gm, node, style, tp)
        except TPShardError as exc:
            exc.node = node
            raise
        for target, place in node_claims:
            claims.setdefault(canonical.get(target, target), []).append((place, node, text))
            used_rules.add(text)
        matched_without_param.setdefault(text, node)
    for text, node in matched_without_param.items():
        if text not in used_rules and styles[node] != "replicate":
            raise _at(node, TPShardError(
                f"tensor_parallel rule {text!r} ({styles[node]}) matches module {node.meta.get(META_MODULE)!r}, "
                f"which has no linear/embedding/expert parameter to shard (first node: {fmt(node)}); name the "
                "projection modules instead"))
    params: dict[str, Placement] = {}
    readers: dict[str, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in canonical:
            readers.setdefault(canonical[str(node.target)], []).extend(
                u for u in node.users if u.op == "call_function" and u.target not in NOT_OUTPUT)
    for target, uses in claims.items():
        first = uses[0]
        claimed = {node.meta.get(META_MODULE) for _, node, _ in uses}
        if first[0].is_s:
            # a tied weight is one tensor: every reader must agree on its layout, or the copies held
            # by different pipeline stages would be different pieces (their gradient sum would break)
            stray = next((u for u in readers.get(target, []) if u.meta.get(META_MODULE) not in claimed), None)
            if stray is not None:
                raise _at(first[1], TPShardError(
                    f"parameter {target} is split by rule {first[2]!r} ({first[0]}, module "
                    f"{first[1].meta.get(META_MODULE)!r}) but is also read by module {stray.meta.get(META_MODULE)!r} "
                    f"({fmt(stray)}{source_of(stray)}), which no rule splits the same way; a tied weight needs one "
                    "layout: give that module the matching style (an embedding's tied LM head: vocab_loss) or "
                    "replicate both"))
        for place, node, text in uses[1:]:
            if place != first[0]:
                raise _at(node, TPShardError(
                    f"parameter {target} is used by {fmt(first[1])} as {first[0]} (rule {first[2]!r}) and by "
                    f"{fmt(node)} as {place} (rule {text!r}); tied parameters need one placement"))
        place, node, text = first
        if place.is_s:
            shape = list(_attr(gm, target).shape)
            if shape[place.dim] % (tp * place.parts):
                raise _at(node, TPShardError(
                    f"cannot shard {target} (rule {text!r}, used by {fmt(node)}): dim {place.dim} has size "
                    f"{shape[place.dim]}, which does not divide by tp={tp}" +
                    (f" × {place.parts} fused blocks" if place.parts > 1 else "")))
            for alias in aliases[id(_attr(gm, target))]:
                params[alias] = place
    return params, styles


def _views_as_reshapes(graph: torch.fx.Graph) -> None:
    """``view`` -> ``reshape``: the same tensor wherever the view is possible, a copy where it is not.
    Export drops a ``.contiguous()`` that is a no-op in the trace (SDPA's output, laid out (b, t, h, d),
    transposed back: torchtitan's ``output.transpose(1, 2).contiguous().view(bs, seqlen, -1)``), and
    the rank's collectives lay their outputs out otherwise (an all-gathered sequence shard feeds
    SDPA contiguous, which then returns another layout): its ``view`` had failed on every rank after
    launch ('view size is not compatible with input tensor's size and stride')."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.view.default:
            node.target = aten.reshape.default


def _at(node: Node, exc: TPShardError) -> TPShardError:
    exc.node = node
    return exc


def _claims_of(gm: torch.fx.GraphModule, node: Node, style: str, tp: int) -> list[tuple[str, Placement]]:
    """(parameter, placement) claims of one node of a module with ``style``: the weight dim and the
    bias handling come from the style table (``planner.tp_styles``), the module kind from the op."""
    params = [a for a in node.all_input_nodes if a.op == "get_attr" and META_PARAM in a.meta]
    if not params:
        return []
    st = STYLES[style]
    if not st.weight_dim:
        return [(str(a.target), R) for a in params]
    if "experts" in st.weight_dim:
        return [(str(a.target), S(st.weight_dim["experts"])) for a in params if _attr(gm, str(a.target)).dim() >= 3]
    if node.target not in WEIGHT_OPS:
        return []
    kind, wpos, bpos = WEIGHT_OPS[node.target]
    w = args_of(node)[wpos] if len(args_of(node)) > wpos else None
    b = args_of(node)[bpos] if bpos is not None and len(args_of(node)) > bpos else None
    if not (isinstance(w, Node) and w in params and _attr(gm, str(w.target)).dim() == 2):
        return []
    dim = split_dim(style, kind)
    if dim is None:
        usable = sorted(name for name, other in STYLES.items() if kind in other.weight_dim) + ["replicate"]
        raise TPShardError(f"style {style!r} does not apply to the {kind} op {fmt(node)}; use one of {usable}")
    parts = _infer_parts(node) if st.fused_blocks and kind != "embedding" else 1
    out = [(str(w.target), S(dim, parts))]
    if isinstance(b, Node) and b in params:
        out.append((str(b.target), S(0, parts) if st.bias == "split" else R))
    return out


def _infer_parts(node: Node) -> int:
    """Number of equal blocks a colwise output is split into downstream (fused q|k|v -> 3), else 1."""
    cur = node
    while True:
        users = [u for u in cur.users if "_assert_tensor_metadata" not in str(u.target)]
        if len(users) != 1:
            return 1
        (user,) = users
        if user.target in _PASSTHROUGH:
            cur = user
            continue
        val = cur.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return 1
        last = val.dim() - 1
        if user.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
            dim: Any = args_of(user)[2] if len(args_of(user)) > 2 else user.kwargs.get("dim", 0)
            if dim % val.dim() != last:
                return 1
            sizes = {int(v.shape[last]) for v in user.meta.get("val", [])}
            count = len(user.meta.get("val", []))
            return count if len(sizes) == 1 and count > 1 else 1
        return 1


def _attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# ------------------------------------------------------------------------------------------ assembly


def _build_module(gm: torch.fx.GraphModule, rw: Rewriter, params: dict[str, Placement], *, tp_index: int,
                  tp_size: int, axis: str, sp: bool) -> torch.fx.GraphModule:
    root: dict[str, Any] = {}
    old = gm.meta.get(META_LAYOUT)
    layout = ParamLayout(keys=dict(old.keys), tp=dict(old.tp), flat=dict(old.flat)) if old else ParamLayout()
    sharded: dict[str, str] = {}
    sliced: dict[int, Any] = {}  # id of a full tensor -> its local piece (tied names share one)
    for node in rw.graph.nodes:
        if node.op == "call_module":
            root[str(node.target)] = _attr(gm, str(node.target))
        if node.op != "get_attr":
            continue
        target = str(node.target)
        value = _attr(gm, target)
        key = node.meta.get(META_PARAM)
        if key is not None and old is None:
            layout.keys[target] = key
        place = params.get(target)
        if place is not None and place.is_s:
            key = layout.keys.get(target, key or target)
            shard = TensorShard(key=key, global_shape=tuple(value.shape), dim=place.dim, index=tp_index,
                                count=tp_size, parts=place.parts, axis=axis)
            if id(value) not in sliced:
                local = shard.slice(value.detach())
                sliced[id(value)] = torch.nn.Parameter(local, requires_grad=value.requires_grad) \
                    if isinstance(value, torch.nn.Parameter) else local
            value = sliced[id(value)]
            layout.tp[key] = shard
            sharded[key] = str(place)
        root[target] = value
    out = torch.fx.GraphModule(root, rw.graph, class_name=type(gm).__name__)
    out.meta = dict(gm.meta)
    out.meta[META_LAYOUT] = layout
    out.meta[META_TP_SUMMARY] = {"tp_size": tp_size, "tp_index": tp_index, "axis": axis, "sequence_parallel": sp,
                              "sharded": sharded, "collectives": collective_counts(out)}
    return out
