"""Sharding rules of ``shard_tensor_parallel_pass`` for reductions, softmax, norms and matmuls.

Matmuls with a parameter weight follow the weight's placement (column-parallel: output sharded on
its last dim; row-parallel: input sharded on its last dim, output a partial sum, bias added once),
which dims are "column" and "row" for each op comes from the style table (``planner.tp_styles``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from passes.tp.placement import Placement, P, R, S, partial_moved
from passes.tp.rewrite import Rewriter, TPShardError, args_of, fmt
from passes.tp.rules import _nd, _resolve_partials
from planner.tp_styles import split_dim

aten = torch.ops.aten

# op -> (module kind of its weight in planner.tp_styles, weight arg position, bias arg position):
# aten.linear takes nn.Linear's [out, in] weight; addmm/mm/matmul with a 2-D parameter take HF Conv1D's [in, out]
WEIGHT_OPS: dict[Any, tuple[str, int, int | None]] = {
    aten.linear.default: ("linear", 1, 2), aten.addmm.default: ("conv1d", 2, 0),
    aten.mm.default: ("conv1d", 1, None), aten.matmul.default: ("conv1d", 1, None),
    aten.embedding.default: ("embedding", 0, None),
}


def _dims_arg(node: Node, n: int, pos: int = 1) -> list[int]:
    dims = args_of(node)[pos] if len(args_of(node)) > pos else node.kwargs.get("dim")
    if dims is None:
        return list(range(n))
    listed: list[Any] = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    return [_nd(d, n) for d in listed] or list(range(n))


def reduction(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """sum/mean/amax/amin over dims (keepdim at arg 2). A sum over the sharded dim is a partial sum;
    sums and means of a partial sum stay partial (they are linear)."""
    x = args_of(node)[0]
    px = rw.p(x)
    n = rw.ndim(x)
    dims = _dims_arg(node, n)
    keep = bool(args_of(node)[2]) if len(args_of(node)) > 2 else bool(node.kwargs.get("keepdim", False))
    is_sum = node.target in _SUMS

    def kept(d: int) -> int:
        return d if keep else d - sum(1 for q in dims if q < d)

    if px.is_p:
        if node.target in _LINEAR:
            out_p = partial_moved(px, kept(px.dim) if px.disjoint and px.dim not in dims else None)
            return rw.finish(node, {}, out_p), out_p
        px = rw.resolve_target(x)
        want = {x: px}
    else:
        want = {}
    if not px.is_s or px.parts != 1:
        want[x] = R
        return rw.finish(node, want, R), R
    if px.dim in dims:
        if is_sum:
            return rw.finish(node, want, P), P
        want[x] = R
        return rw.finish(node, want, R), R
    d = kept(px.dim)
    return rw.finish(node, want, S(d)), S(d)


_SUMS = {aten.sum.dim_IntList, aten.sum.default}
_LINEAR = _SUMS | {aten.mean.dim, aten.mean.default}


def softmax(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    x = args_of(node)[0]
    want = _resolve_partials(rw, node)
    px = want.get(x, rw.p(x))
    dim = _nd(args_of(node)[1], rw.ndim(x))
    if px.is_s and px.parts == 1 and px.dim != dim:
        return rw.finish(node, want, px), px
    want[x] = R
    return rw.finish(node, want, R), R


def layer_norm(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """layer_norm / rms_norm (x, normalized_shape, weight, ...): a shard outside the normalized dims
    stays a shard; the weight and bias are replicated (sequence parallelism's norms)."""
    x = args_of(node)[0]
    want = _resolve_partials(rw, node)
    px = want.get(x, rw.p(x))
    normalized = len(args_of(node)[1])
    for a in rw.tensor_inputs(node):
        if a is x:
            continue
        if a.op == "get_attr" and rw.p(a).is_s:
            raise TPShardError(f"{fmt(node)}: norm weight {fmt(a)} is sharded ({rw.p(a)}); keep norms replicated")
        want[a] = R
    if px.is_s and px.parts == 1 and px.dim < rw.ndim(x) - normalized:
        return rw.finish(node, want, px), px
    want[x] = R
    return rw.finish(node, want, R), R


# ------------------------------------------------------------------------------------------ matmuls


def _colwise_output(rw: Rewriter, node: Node, new: Node, out: Placement) -> tuple[Node, Any]:
    style = rw.styles.get(node)
    if style == "colwise_gather":
        rw.env[node], rw.place[node] = new, out
        gathered = rw.get(node, R)
        del rw.conv[(node, R)]
        return gathered, R
    return new, out


def linear_like(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """aten.linear (weight [out, in]) and addmm/mm/matmul with a 2-D parameter (weight [in, out])."""
    t = node.target
    kind, wpos, bpos = WEIGHT_OPS[t]
    args = args_of(node)
    w = args[wpos] if len(args) > wpos else None
    b = args[bpos] if bpos is not None and len(args) > bpos else None
    x = args[1] if t == aten.addmm.default else args[0]
    col_dim, row_dim = split_dim("colwise", kind), split_dim("rowwise", kind)
    if not isinstance(w, Node) or rw.ndim(w) != 2 or (t == aten.matmul.default and w.op != "get_attr"):
        return batched_matmul(rw, node)
    if t == aten.addmm.default and (node.kwargs or len(args_of(node)) > 3):
        # beta * input + alpha * (x @ w) (a pairwise distance, center loss's distmat): on whole operands
        return _replicated(rw, node)
    pw = rw.p(w)
    if pw.is_p:  # an activation weight that is a partial sum: resolve it like any other operand
        return batched_matmul(rw, node)
    last = rw.ndim(x) - 1
    if pw.is_r:
        want = _resolve_partials(rw, node)
        if b is not None and not want.get(b, rw.p(b)).is_r:
            if b.op == "get_attr":
                raise TPShardError(f"{fmt(node)}: bias {fmt(b)} is {rw.p(b)} but the weight {fmt(w)} is replicated; "
                                   "split both (colwise) or neither")
            want[b] = R
        px = want.get(x, rw.p(x))
        # A replicated weight on a sequence/batch shard computes locally, but its gradient is then
        # a sum over shards (an all-reduce of |W|); gathering the input instead moves |x|. Take the
        # cheaper (a replicated LM head under sequence parallelism gathers its input).
        w_numel = rw.shape(w)[0] * rw.shape(w)[1]
        x_numel = 1
        for size in rw.shape(x):
            x_numel *= size
        if px.is_s and px.dim != last and px.parts == 1 and w_numel < x_numel:
            return rw.finish(node, want, px), px
        want[x] = R
        return rw.finish(node, want, R), R
    if pw.is_s and pw.dim == col_dim:
        out = S(rw.ndim(node) - 1, pw.parts)
        want = {x: R}
        if b is not None and rw.p(b) != S(0, pw.parts):
            raise TPShardError(f"{fmt(node)}: bias {fmt(b)} is {rw.p(b)}, expected S(0) like the colwise weight")
        new = rw.finish(node, want, out)
        if rw.styles.get(node) == "vocab_loss":
            rw.strict[node] = node
        return _colwise_output(rw, node, new, out)
    if pw.is_s and pw.dim == row_dim:
        if pw.parts != 1:
            raise TPShardError(f"{fmt(node)}: a row-parallel weight cannot be fused ({pw})")
        want = {x: S(last)}
        if t == aten.addmm.default:
            mm = rw.finish(node, want, P, target=aten.mm.default, args=(x, w))
        else:
            mm = rw.finish(node, want, P, args=(x, w) if b is not None else None)
        if b is None:
            return mm, P
        if not rw.p(b).is_r:
            raise TPShardError(f"{fmt(node)}: bias {fmt(b)} of a row-parallel weight is {rw.p(b)}; it must be "
                               "replicated (it is added once, after the reduction)")
        return _add_bias(rw, node, mm, b)
    raise TPShardError(f"{fmt(node)}: weight {fmt(w)} is {pw}, which is neither column- nor row-parallel")


def _add_bias(rw: Rewriter, node: Node, mm: Node, b: Node) -> tuple[Node, Any]:
    """Row-parallel output plus a replicated bias. The bias is added after the reduction (Megatron);
    under sequence parallelism a 2-D output cannot be sequence-sharded, so every rank adds bias/tp
    before the reduce-scatter (exact for power-of-two tp) and the gradient of bias/tp is
    all-reduced (tp · g/tp = g on every rank), as sequence parallelism needs for every replicated
    parameter anyway. The parameter's direct user is the scaling, which makes a new tensor: no view
    of the parameter outlives its FSDP unit."""
    target = rw.resolve_target(node)
    if rw.sp and target.is_r:
        scaled = rw.emit(aten.mul.Tensor, (rw.env[b], 1.0 / rw.tp), place=R)
        if rw.grad.get(b, False):
            scaled = rw.copied(scaled, b)
        out = rw.emit(aten.add.Tensor, (mm, scaled), place=P)
        rw.set_local_val(out, node, P)
        return out, P
    rw.env[node], rw.place[node] = mm, P
    reduced = rw.get(node, target)
    del rw.conv[(node, target)]
    bias = rw.env[b]
    if not target.is_r and rw.grad.get(b, False):
        bias = rw.copied(bias, b)
    out = rw.emit(aten.add.Tensor, (reduced, bias), place=target)
    rw.set_local_val(out, node, target)
    return out, target


def batched_matmul(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """Activation x activation matmul/bmm: both sharded on the same batch dim, else replicated."""
    a, b = args_of(node)[0], args_of(node)[1]
    want = _resolve_partials(rw, node)
    pa, pb = want.get(a, rw.p(a)), want.get(b, rw.p(b))
    if pa.is_s and pa == pb and pa.parts == 1 and pa.dim < rw.ndim(a) - 2 and rw.ndim(a) == rw.ndim(b):
        return rw.finish(node, want, pa), pa
    return _replicated(rw, node)


def _replicated(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """``node`` on every tensor operand whole (addmm's third operand too), its output replicated."""
    return rw.finish(node, {t: R for t in rw.tensor_inputs(node)}, R), R
