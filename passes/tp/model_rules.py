"""Sharding rules for model-level ops (embedding, losses, attention, MoE experts, indexing) and the
op -> rule table of ``shard_tensor_parallel_pass``. Generic rules live in ``passes.tp.rules``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from passes.ops import tp_ops
from passes.tp.placement import PD, P, Placement, R, S
from passes.tp.rewrite import Rewriter, TPShardError, args_of, fmt
from passes.tp.rules import (ELEMENTWISE, NOT_OUTPUT, VIEWS, Rule, _gather_all, _nd, _ops, _resolve_partials,
                             assert_meta, batched_matmul, cat, dim_op, elementwise, expand, fallback, getitem,
                             layer_norm, linear_like, reduction, slice_like, softmax, split, view)

__all__ = ["RULES", "rule_for"]

aten = torch.ops.aten

def embedding(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    w, ids = args_of(node)[0], args_of(node)[1]
    pw = rw.p(w)
    if len(args_of(node)) > 3 and (args_of(node)[3] or (len(args_of(node)) > 4 and args_of(node)[4])):
        if not pw.is_r:
            raise TPShardError(f"{fmt(node)}: scale_grad_by_freq/sparse embeddings cannot be vocab-sharded")
    if pw.is_r:
        want = {ids: R} if not rw.p(ids).is_r else {}
        return rw.finish(node, want, R), R
    if pw == S(0):
        padding = int(args_of(node)[2]) if len(args_of(node)) > 2 else -1
        start = rw.index * (rw.shape(w)[0] // rw.tp)
        new = rw.finish(node, {ids: R}, P, target=tp_ops.vocab_parallel_embedding, args=(w, ids, start, padding),
                        kwargs={})
        return new, P
    if pw == S(1):
        out = S(rw.ndim(node) - 1)
        return rw.finish(node, {ids: R}, out), out
    raise TPShardError(f"{fmt(node)}: embedding weight is {pw}")


def cross_entropy(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    x, target = args_of(node)[0], args_of(node)[1]
    args: list[Any] = list(args_of(node)) + [None, 1, -100, 0.0][len(args_of(node)) - 2:]
    weight, reduction, ignore, smoothing = args[2], args[3], args[4], args[5]
    kwargs: dict[str, Any] = dict(node.kwargs)
    for k, v in kwargs.items():
        if k == "weight":
            weight = v
        elif k == "reduction":
            reduction = v
        elif k == "ignore_index":
            ignore = v
        elif k == "label_smoothing":
            smoothing = v
    px = rw.p(x)
    if px.is_s and px.dim == 1 and px.parts == 1 and rw.ndim(x) == 2:
        if weight is not None or smoothing:
            raise TPShardError(f"{fmt(node)}: vocab-parallel cross-entropy supports no class weights and no "
                               "label smoothing; replicate the LM head (or use 'colwise_gather') instead")
        return _vocab_ce(rw, node, x, target, int(ignore), int(reduction))
    return rw.finish(node, {a: R for a in rw.tensor_inputs(node)}, R), R


def _vocab_ce(rw: Rewriter, node: Node, logits: Node, target: Node, ignore: int, reduction: int) -> tuple[Node, Any]:
    start = rw.index * (rw.shape(logits)[1] // rw.tp)
    new = rw.finish(node, {target: R}, R, target=tp_ops.vocab_parallel_cross_entropy,
                    args=(logits, target, rw.axis, start, ignore, reduction), kwargs={})
    return new, R


def log_softmax(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """log_softmax over a vocab-sharded dim feeding only nll_loss: fused into vocab-parallel CE."""
    x = args_of(node)[0]
    px = rw.p(x)
    dim = _nd(args_of(node)[1], rw.ndim(x))
    nll = [u for u in node.users if str(u.target).startswith("aten.nll_loss")]
    if px.is_s and px.dim == dim == 1 and px.parts == 1 and rw.ndim(x) == 2 and node.users and \
            len(nll) == len(node.users) and all(args_of(u)[0] is node for u in nll):
        rw.place[node] = ("log_softmax", x)
        return rw.env[x], ("log_softmax", x)
    return softmax(rw, node)


def nll_loss(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    src = args_of(node)[0]
    marker = rw.place.get(src)
    if isinstance(marker, tuple) and marker[0] == "log_softmax":
        args: list[Any] = list(args_of(node)) + [None, 1, -100][len(args_of(node)) - 2:]
        if args[2] is not None:
            raise TPShardError(f"{fmt(node)}: vocab-parallel nll_loss supports no class weights")
        return _vocab_ce(rw, node, marker[1], args_of(node)[1], int(args[4]), int(args[3]))
    return rw.finish(node, {a: R for a in rw.tensor_inputs(node)}, R), R


def sdpa(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    q, k, v = args_of(node)[:3]
    want = _resolve_partials(rw, node)
    heads = [want.get(t, rw.p(t)) for t in (q, k, v)]
    if any(h.is_s and h.dim == 1 and h.parts == 1 for h in heads):
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
    want: dict[Node, Placement] = {offs: R}
    if not (px.is_r or (px.is_p and px.disjoint)):
        want[x] = R
    start = rw.index * (rw.shape(w)[0] // rw.tp)
    new = rw.finish(node, want, PD, target=tp_ops.expert_grouped_mm, args=(x, w, offs, start))
    return new, PD


def index(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """x[idx] with index tensors on leading dims: partial sums stay partial, later-dim shards stay."""
    x, idx = args_of(node)[0], args_of(node)[1]
    px = rw.p(x)
    tensors = [i for i in idx if isinstance(i, Node)]
    if any(not rw.p(i).is_r for i in tensors):
        return rw.finish(node, _gather_all(rw, node), R), R
    if px.is_p and len(idx) >= 1 and all(isinstance(i, Node) for i in idx):
        return rw.finish(node, {}, px), px
    if px.is_s and len(idx) == 1 and px.dim >= 1 and isinstance(idx[0], Node):
        out = S(px.dim - 1 + rw.ndim(idx[0]), px.parts)
        return rw.finish(node, {}, out), out
    return rw.finish(node, _gather_all(rw, node), R), R


RULES: dict[Any, Rule] = {}
for _op in ELEMENTWISE:
    RULES[_op] = elementwise
for _op in VIEWS | _ops("flatten.using_ints"):
    RULES[_op] = view
for _op in _ops("transpose.int", "permute", "t", "unsqueeze", "squeeze"):
    RULES[_op] = dim_op
for _op in NOT_OUTPUT:
    RULES[_op] = assert_meta
RULES.update({
    aten.expand.default: expand, aten.slice.Tensor: slice_like, aten.select.int: slice_like,
    aten.split.Tensor: split, aten.split_with_sizes.default: split, aten.chunk.default: split,
    aten.cat.default: cat, operator.getitem: getitem,
    aten.sum.dim_IntList: reduction, aten.mean.dim: reduction, aten.amax.default: reduction,
    aten.softmax.int: softmax, aten._softmax.default: softmax, aten.layer_norm.default: layer_norm,
    aten.log_softmax.int: log_softmax, aten._log_softmax.default: log_softmax,
    aten.linear.default: linear_like, aten.addmm.default: linear_like, aten.mm.default: linear_like,
    aten.matmul.default: linear_like, aten.bmm.default: batched_matmul,
    aten.embedding.default: embedding, aten.cross_entropy_loss.default: cross_entropy,
    aten.nll_loss.default: nll_loss, aten.nll_loss_forward.default: nll_loss, aten.nll_loss_nd.default: nll_loss,
    aten.scaled_dot_product_attention.default: sdpa, aten.index.Tensor: index,
})
# Hugging Face registers its MoE op when transformers' MoE integration is imported; match by name
NAMED_RULES: dict[str, Rule] = {"transformers.grouped_mm_fallback.default": grouped_mm}


def rule_for(target: Any) -> Rule:
    return RULES.get(target) or NAMED_RULES.get(str(target), fallback)
