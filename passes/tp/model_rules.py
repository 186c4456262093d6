"""Sharding rules for model-level ops (embedding, losses, attention, MoE experts, indexing) and the
op -> rule table of ``shard_tensor_parallel_pass``. Generic rules live in ``passes.tp.rules``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from passes.ops import tp_ops
from passes.tp.placement import PD, P, Placement, R, S, partial_moved
from passes.tp.rewrite import Rewriter, TPShardError, args_of, fmt
from passes.tp.rules import (ELEMENTWISE, NOT_OUTPUT, VIEWS, Rule, _gather_all, _nd, _ops, _resolve_partials,
                             assert_meta, elementwise, fallback)
from passes.tp.rules_matmul import batched_matmul, layer_norm, linear_like, reduction, softmax
from passes.tp.rules_shape import (cat, dim_op, expand, flatten, getitem, slice_like, split, unflatten, view,
                                   view_dtype)
from planner.tp_styles import split_dim

__all__ = ["RULES", "rule_for"]

aten = torch.ops.aten

def _dim(style: str, kind: str) -> int:
    """The weight dim ``style`` splits for ``kind`` (a style that splits one)."""
    d = split_dim(style, kind)
    assert d is not None, (style, kind)
    return d


def _arg(node: Node, pos: int, name: str, default: Any) -> Any:
    """Argument ``name`` of an ATen call, given positionally at ``pos`` or by keyword."""
    args = args_of(node)
    return args[pos] if len(args) > pos else node.kwargs.get(name, default)


def embedding(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """embedding(weight, ids, padding_idx, scale_grad_by_freq, sparse): vocabulary rows split ->
    masked lookup with a partial-sum output; embedding columns split -> output sharded on its last dim
    (the dims come from ``planner.tp_styles``)."""
    w, ids = args_of(node)[0], args_of(node)[1]
    pw = rw.p(w)
    if _arg(node, 3, "scale_grad_by_freq", False) or _arg(node, 4, "sparse", False):
        if not pw.is_r:
            raise TPShardError(f"{fmt(node)}: scale_grad_by_freq/sparse embeddings cannot be vocab-sharded")
    if pw.is_r:
        want = {ids: R} if not rw.p(ids).is_r else {}
        return rw.finish(node, want, R), R
    if pw == S(_dim("vocab_embedding", "embedding")):
        padding = int(_arg(node, 2, "padding_idx", -1))
        start = rw.index * (rw.shape(w)[0] // rw.tp)
        new = rw.finish(node, {ids: R}, P, target=tp_ops.vocab_parallel_embedding, args=(w, ids, start, padding),
                        kwargs={})
        return new, P
    if pw == S(_dim("colwise", "embedding")):
        out = S(rw.ndim(node) - 1)
        return rw.finish(node, {ids: R}, out), out
    raise TPShardError(f"{fmt(node)}: embedding weight is {pw}")


def cross_entropy(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """cross_entropy_loss(logits [N, V], target [N], weight, reduction, ignore_index, label_smoothing):
    on vocab-sharded logits, Megatron's vocab-parallel cross-entropy (``tp_ops``)."""
    x, target = args_of(node)[0], args_of(node)[1]
    weight = _arg(node, 2, "weight", None)
    reduction = int(_arg(node, 3, "reduction", 1))
    ignore = int(_arg(node, 4, "ignore_index", -100))
    smoothing = float(_arg(node, 5, "label_smoothing", 0.0))
    px = rw.p(x)
    if px.is_s and px.dim == 1 and px.parts == 1 and rw.ndim(x) == 2 and rw.ndim(target) == 1:
        if weight is not None:
            raise TPShardError(f"{fmt(node)}: the vocab-parallel cross-entropy takes no class weights; use "
                               "'colwise_gather' (or 'replicate') for the LM head instead of 'vocab_loss'")
        return _vocab_ce(rw, node, x, target, ignore, reduction, smoothing)
    return rw.finish(node, {a: R for a in rw.tensor_inputs(node)}, R), R


def _vocab_ce(rw: Rewriter, node: Node, logits: Node, target: Node, ignore: int, reduction: int,
              smoothing: float = 0.0) -> tuple[Node, Any]:
    start = rw.index * (rw.shape(logits)[1] // rw.tp)
    new = rw.finish(node, {target: R}, R, target=tp_ops.vocab_parallel_cross_entropy,
                    args=(logits, target, rw.axis, start, ignore, reduction, smoothing), kwargs={})
    return new, R


def log_softmax(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """log_softmax over a vocab-sharded dim feeding only nll_loss: fused into vocab-parallel CE."""
    x = args_of(node)[0]
    px = rw.p(x)
    dim = _nd(args_of(node)[1], rw.ndim(x))
    nll = [u for u in node.users if u.target in _NLL]
    if px.is_s and px.dim == dim == 1 and px.parts == 1 and rw.ndim(x) == 2 and node.users and \
            len(nll) == len(node.users) and all(args_of(u)[0] is node for u in nll):
        rw.place[node] = ("log_softmax", x)
        return rw.env[x], ("log_softmax", x)
    return softmax(rw, node)


def nll_loss(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    src = args_of(node)[0]
    marker = rw.place.get(src)
    if isinstance(marker, tuple) and marker[0] == "log_softmax":
        if _arg(node, 2, "weight", None) is not None:
            raise TPShardError(f"{fmt(node)}: the vocab-parallel nll_loss takes no class weights; use "
                               "'colwise_gather' (or 'replicate') for the LM head instead of 'vocab_loss'")
        return _vocab_ce(rw, node, marker[1], args_of(node)[1], int(_arg(node, 4, "ignore_index", -100)),
                         int(_arg(node, 3, "reduction", 1)))
    return rw.finish(node, {a: R for a in rw.tensor_inputs(node)}, R), R


_NLL = {aten.nll_loss.default, aten.nll_loss_nd.default}


def sdpa(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    q, k, v = args_of(node)[:3]
    want = _resolve_partials(rw, node)
    heads = [want.get(t, rw.p(t)) for t in (q, k, v)]
    # dim 1 is the heads' only in [b, h, t, d]: of [b, t, d] (attention without heads) it is the
    # sequence, which sequence parallelism shards, and each rank would attend to its own keys alone
    if all(len(rw.shape(t)) == 4 for t in (q, k, v)) and any(h.is_s and h.dim == 1 and h.parts == 1 for h in heads):
        out = S(1)
        for t in (q, k, v):
            want[t] = out
        mask = args_of(node)[3] if len(args_of(node)) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, Node):
            pm = want.get(mask, rw.p(mask))
            mshape = rw.shape(mask)
            aligned = len(mshape) - 3  # the mask broadcasts against [b, h, t, s]
            if aligned >= 0 and mshape[aligned] != 1:
                want[mask] = S(aligned)
            elif not pm.is_r:
                want[mask] = R
        return rw.finish(node, want, out), out
    return rw.finish(node, {a: R for a in rw.tensor_inputs(node)}, R), R


def grouped_mm(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """transformers::grouped_mm_fallback(x [T, K] sorted by expert, w [E, K, N], offsets [E])."""
    x, w, offs = args_of(node)[:3]
    pw = rw.p(w)
    if pw.is_r:
        return rw.finish(node, {a: R for a in rw.tensor_inputs(node)}, R), R
    if pw != S(0):
        raise TPShardError(f"{fmt(node)}: expert weights must be sharded along the expert dim 0, got {pw}")
    px = rw.p(x)
    # rows are sorted by expert and partitioned by the offsets: this rank computes the rows of its
    # experts, so the output is disjoint along dim 0 under the partition named by the offsets
    support = PD(f"experts:{offs.name}", 0)
    want: dict[Node, Placement] = {offs: R}
    if not (px.is_r or px == support):
        want[x] = R
    start = rw.index * (rw.shape(w)[0] // rw.tp)
    new = rw.finish(node, want, support, target=tp_ops.expert_grouped_mm, args=(x, w, offs, start))
    return new, support


def index(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """x[idx] with index tensors on leading dims: partial sums stay partial, later-dim shards stay."""
    x, idx = args_of(node)[0], args_of(node)[1]
    px = rw.p(x)
    tensors = [i for i in idx if isinstance(i, Node)]
    if any(not rw.p(i).is_r for i in tensors):
        return rw.finish(node, _gather_all(rw, node), R), R
    if px.is_p and len(idx) >= 1 and all(isinstance(i, Node) for i in idx):
        # gathering rows is linear; it moves a disjoint partial's rows, so the result is an ordinary P
        keep = px.disjoint and px.dim >= len(idx)
        out_p = partial_moved(px, px.dim - len(idx) + max(rw.ndim(i) for i in tensors) if keep else None)
        return rw.finish(node, {}, out_p), out_p
    if px.is_s and len(idx) == 1 and px.dim >= 1 and isinstance(idx[0], Node):
        out = S(px.dim - 1 + rw.ndim(idx[0]), px.parts)
        return rw.finish(node, {}, out), out
    return rw.finish(node, _gather_all(rw, node), R), R


RULES: dict[Any, Rule] = {}
"""ATen op -> sharding rule. Every entry has conformance cases in tests/passes/test_tp_conformance.py."""
for _op in ELEMENTWISE:
    RULES[_op] = elementwise
for _op in VIEWS:
    RULES[_op] = view
for _op in _ops("transpose.int", "permute", "t", "unsqueeze", "squeeze.dim", "squeeze.dims", "squeeze"):
    RULES[_op] = dim_op
for _op in NOT_OUTPUT:
    RULES[_op] = assert_meta
RULES.update({
    aten.flatten.using_ints: flatten, aten.unflatten.int: unflatten, aten.view.dtype: view_dtype,
    aten.expand.default: expand, aten.slice.Tensor: slice_like, aten.select.int: slice_like,
    aten.split.Tensor: split, aten.split_with_sizes.default: split, aten.chunk.default: split,
    aten.cat.default: cat, operator.getitem: getitem,
    aten.sum.dim_IntList: reduction, aten.sum.default: reduction, aten.mean.dim: reduction,
    aten.mean.default: reduction, aten.amax.default: reduction, aten.amin.default: reduction,
    aten.softmax.int: softmax, aten._softmax.default: softmax,
    aten.layer_norm.default: layer_norm, aten.rms_norm.default: layer_norm,
    aten.log_softmax.int: log_softmax, aten._log_softmax.default: log_softmax,
    aten.linear.default: linear_like, aten.addmm.default: linear_like, aten.mm.default: linear_like,
    aten.matmul.default: linear_like, aten.bmm.default: batched_matmul,
    aten.embedding.default: embedding, aten.cross_entropy_loss.default: cross_entropy,
    aten.nll_loss.default: nll_loss, aten.nll_loss_nd.default: nll_loss,
    aten.scaled_dot_product_attention.default: sdpa, aten.index.Tensor: index,
})
# Hugging Face registers its MoE op when transformers' MoE integration is imported; match by name
NAMED_RULES: dict[str, Rule] = {"transformers.grouped_mm_fallback.default": grouped_mm}


def rule_for(target: Any) -> Rule:
    return RULES.get(target) or NAMED_RULES.get(str(target), fallback)
