"""Generic per-op sharding rules of ``shard_tensor_parallel_pass`` (model ops and the op table are in
``passes.tp.model_rules``): which placements an aten op can compute
on, what placement its output has, and how its constant arguments change for local shapes.

Every rule takes the :class:`~passes.tp.rewrite.Rewriter` and the old node, emits the new node(s)
and returns ``(new_node, placement)``. An op without a rule runs on replicated inputs (shards are
gathered, partial sums reduced), which is always correct; a sharded *parameter* reaching such an
op is an error instead, since gathering a weight every step would silently undo the plan.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch.fx import Node

from passes.ops import tp_ops
from passes.tp.placement import PD, Placement, P, R, S, local_shape, map_view_dim
from passes.tp.rewrite import Rewriter, TPShardError, args_of, fmt

aten = torch.ops.aten
Rule = Callable[[Rewriter, Node], tuple[Node, Any]]

# ------------------------------------------------------------------------------------------ tables


def _ops(*names: str) -> set[Any]:
    out: set[Any] = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(aten, packet, None)
        if op is None:
            continue
        if overload:
            if hasattr(op, overload):
                out.add(getattr(op, overload))
        else:
            out.update(getattr(op, o) for o in op.overloads())
    return out


ELEMENTWISE = _ops(
    "add", "sub", "rsub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "silu",
    "gelu", "relu", "erf", "abs", "clamp", "where", "masked_fill", "to", "_to_copy", "clone", "contiguous",
    "alias", "detach", "dropout", "eq", "ne", "lt", "le", "gt", "ge", "__and__", "__or__", "logical_not",
    "bitwise_not", "type_as", "reciprocal", "square", "softplus", "leaky_relu", "hardtanh", "add_", "mul_",
    "div_", "sub_", "floor_divide", "sin", "cos", "exp2", "log1p", "expm1", "lerp", "fill", "zeros_like",
    "ones_like", "empty_like", "full_like", "maximum", "minimum", "float_power", "sign")
# elementwise ops through which a partial sum stays a partial sum (linear in one partial input)
P_UNARY = _ops("neg", "to", "_to_copy", "clone", "contiguous", "alias", "detach")
P_SCALE = _ops("mul.Tensor", "mul.Scalar", "div.Tensor", "div.Scalar", "mul_.Tensor", "div_.Tensor")
# f(0) == 0: safe on disjoint partial sums (each element lives on one rank, zeros elsewhere)
P_ZERO_PRESERVING = _ops("silu", "gelu", "relu", "tanh", "mul.Tensor")
VIEWS = _ops("view", "reshape", "_unsafe_view")
NOT_OUTPUT = _ops("_assert_tensor_metadata")

# ------------------------------------------------------------------------------------------ helpers


def _nd(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _gather_all(rw: Rewriter, node: Node) -> dict[Node, Placement]:
    for a in rw.tensor_inputs(node):
        if a.op == "get_attr" and not rw.p(a).is_r:
            raise TPShardError(
                f"{fmt(node)} uses the tensor-parallel-sharded parameter {a.target} ({rw.p(a)}), but the pass "
                f"has no sharding rule for {node.target}; mark its module 'replicate' in the plan")
    return {a: R for a in rw.tensor_inputs(node)}


def _resolve_partials(rw: Rewriter, node: Node) -> dict[Node, Placement]:
    return {a: rw.resolve_target(a) for a in rw.tensor_inputs(node) if rw.p(a).is_p}


def _placed(rw: Rewriter, a: Node, want: dict[Node, Placement]) -> Placement:
    return want.get(a, rw.p(a))


def fallback(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """Any op: replicated inputs, replicated output(s)."""
    v = rw.val(node)
    out: Any = [R] * len(v) if isinstance(v, (tuple, list)) else R
    new = rw.finish(node, _gather_all(rw, node), out)
    new.meta["fs_tp_fallback"] = True
    return new, out


# ------------------------------------------------------------------------------------------ elementwise


def elementwise(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    ins = rw.tensor_inputs(node)
    places = [rw.p(a) for a in ins]
    inplace = str(node.target).split(".")[-2].endswith("_") if "." in str(node.target) else False
    if any(p.is_p for p in places):
        out_p = _partial_elementwise(node, ins, places)
        if out_p is not None:
            return rw.finish(node, {}, out_p), out_p
    want = _resolve_partials(rw, node)
    out_nd = rw.ndim(node) if rw.is_tensor(node) else 0
    out_shape = rw.shape(node) if rw.is_tensor(node) else []
    chosen: Placement | None = None
    for a in ins:
        pl = _placed(rw, a, want)
        if pl.is_s:
            chosen = S(pl.dim + out_nd - rw.ndim(a), pl.parts)
            break
    if chosen is None:
        return rw.finish(node, want, R), R
    for a in ins:
        pl = _placed(rw, a, want)
        shift = out_nd - rw.ndim(a)
        local_dim = chosen.dim - shift
        if pl.is_s:
            if S(pl.dim + shift, pl.parts) != chosen:
                want[a] = S(local_dim) if local_dim >= 0 else R
        elif local_dim >= 0 and rw.shape(a)[local_dim] != 1:
            if chosen.parts != 1:
                raise TPShardError(f"{fmt(node)} combines the fused shard {chosen} with the full tensor {fmt(a)}")
            want[a] = S(local_dim)
    if inplace and ins and want.get(ins[0], rw.p(ins[0])) != rw.p(ins[0]):
        raise TPShardError(f"in-place {fmt(node)} would need its input converted from {rw.p(ins[0])}")
    del out_shape
    if node.target == aten.dropout.default and args_of(node)[1] > 0 and args_of(node)[2]:
        # each shard needs its own mask (the same mask on every rank would correlate the shards)
        new = rw.finish(node, want, chosen, target=tp_ops.sharded_dropout,
                        args=(args_of(node)[0], args_of(node)[1], args_of(node)[2], rw.index))
        return new, chosen
    return rw.finish(node, want, chosen), chosen


def _partial_elementwise(node: Node, ins: list[Node], places: list[Placement]) -> Placement | None:
    parts = [p for p in places if p.is_p]
    others = [p for p in places if not p.is_p]
    disjoint = all(p.disjoint for p in parts)
    if node.target in P_UNARY and len(places) == 1:
        return places[0]
    if len(parts) == 1 and all(o.is_r for o in others):
        if node.target in P_SCALE and (node.target not in _ops("div.Tensor", "div_.Tensor") or places[0].is_p):
            return parts[0]
        if disjoint and node.target in P_ZERO_PRESERVING and len(places) == 1:
            return PD
    if disjoint and len(parts) == len(places) and node.target in P_ZERO_PRESERVING:
        return PD
    return None


def assert_meta(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    return rw.finish(node, {}, None), None


# ------------------------------------------------------------------------------------------ shapes


def view(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    x = args_of(node)[0]
    px = rw.p(x)
    out_shape = rw.shape(node)
    if px.is_r or px.is_p:
        return rw.finish(node, {}, px), px
    k, why = map_view_dim(rw.shape(x), out_shape, px.dim, rw.tp, px.parts)
    if k is None:
        if "does not divide by tp" in why or px.parts != 1 and "fused" in why:
            raise TPShardError(f"cannot shard {fmt(node)}: {why} (input {fmt(x)} is {px}). "
                               "With attention, the number of (key/value) heads must divide by tp")
        return rw.finish(node, {x: R}, R), R
    out = S(k, px.parts)
    return rw.finish(node, {}, out, args=(x, local_shape(out_shape, out, rw.tp), *args_of(node)[2:])), out


def expand(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    x = args_of(node)[0]
    px = rw.p(x)
    if not px.is_s:
        return rw.finish(node, {}, px), px
    out = S(px.dim + rw.ndim(node) - rw.ndim(x), px.parts)
    return rw.finish(node, {}, out, args=(x, local_shape(rw.shape(node), out, rw.tp), *args_of(node)[2:])), out


def _dim_map(rw: Rewriter, node: Node) -> Callable[[int], int | None]:
    """Old dim of the input -> dim of the output for pure dim-permuting/inserting ops."""
    x, t = args_of(node)[0], node.target
    n_in = rw.ndim(x)
    if t == aten.transpose.int:
        a, b = _nd(args_of(node)[1], n_in), _nd(args_of(node)[2], n_in)
        return lambda d: b if d == a else a if d == b else d
    if t == aten.permute.default:
        perm = [_nd(d, n_in) for d in args_of(node)[1]]
        return lambda d: perm.index(d)
    if t == aten.t.default:
        return lambda d: 1 - d if n_in == 2 else d
    if t == aten.unsqueeze.default:
        u = _nd(args_of(node)[1], n_in + 1)
        return lambda d: d + 1 if d >= u else d
    if t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        dims = args_of(node)[1] if len(args_of(node)) > 1 else [i for i, s in enumerate(rw.shape(x)) if s == 1]
        dims = [_nd(d, n_in) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
        dims = [d for d in dims if rw.shape(x)[d] == 1]
        return lambda d: None if d in dims else d - sum(1 for q in dims if q < d)
    raise KeyError(t)


def dim_op(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    x = args_of(node)[0]
    px = rw.p(x)
    if not px.is_s:
        return rw.finish(node, {}, px), px
    d = _dim_map(rw, node)(px.dim)
    out = R if d is None else S(d, px.parts)
    return rw.finish(node, {} if d is not None else {x: R}, out), out


def slice_like(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """slice.Tensor / select.int: fine unless they cut the sharded dim."""
    x = args_of(node)[0]
    px = rw.p(x)
    n_in = rw.ndim(x)
    dim = _nd(args_of(node)[1] if len(args_of(node)) > 1 else 0, n_in)
    if px.is_p and node.target == aten.slice.Tensor:
        return rw.finish(node, {}, px), px
    if not px.is_s:
        want = _resolve_partials(rw, node)
        want = {a: R for a in want}
        return rw.finish(node, want, R), R
    if dim == px.dim:
        whole = node.target == aten.slice.Tensor and rw.shape(node)[dim] == rw.shape(x)[dim]
        if not whole:
            return rw.finish(node, {x: R}, R), R
        out = px
        end = local_shape(rw.shape(x), px, rw.tp)[dim]
        return rw.finish(node, {}, out, args=(x, dim, 0, end, *args_of(node)[4:])), out
    if node.target == aten.select.int:
        out = S(px.dim - (1 if dim < px.dim else 0), px.parts)
    else:
        out = px
    return rw.finish(node, {}, out), out


def split(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """split.Tensor / split_with_sizes / chunk: along another dim, or into the fused blocks."""
    x = args_of(node)[0]
    px = rw.p(x)
    count = len(rw.val(node))
    n_in = rw.ndim(x)
    default_dim = 0
    dim_arg: Any = args_of(node)[2] if len(args_of(node)) > 2 else node.kwargs.get("dim", default_dim)
    dim = _nd(dim_arg, n_in)
    if px.is_p:
        return rw.finish(node, {}, [px] * count), [px] * count
    if not px.is_s:
        want = {x: R} if not px.is_r else {}
        return rw.finish(node, want, [R] * count), [R] * count
    if dim != px.dim:
        return rw.finish(node, {}, [px] * count), [px] * count
    sizes = [int(v.shape[dim]) for v in rw.val(node)]
    if px.parts == count and len(set(sizes)) == 1:
        out = [S(dim)] * count
        local = sizes[0] // rw.tp
        if node.target == aten.chunk.default:
            args: tuple[Any, ...] = (x, count, dim)
        elif node.target == aten.split_with_sizes.default:
            args = (x, [local] * count, dim)
        else:
            args = (x, local, dim)
        return rw.finish(node, {}, out, args=args, kwargs={}), out
    if px.parts != 1:
        raise TPShardError(f"cannot shard {fmt(node)}: it splits the fused dim {dim} ({px.parts} blocks) into "
                           f"{sizes}")
    return rw.finish(node, {x: R}, [R] * count), [R] * count


def cat(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    tensors = args_of(node)[0]
    dim = _nd(args_of(node)[1] if len(args_of(node)) > 1 else 0, rw.ndim(node))
    places = [rw.p(t) for t in tensors]
    first = next((p for p in places if p.is_s and p.dim != dim and p.parts == 1), None)
    if all(p.is_p for p in places):
        return rw.finish(node, {}, P), P
    if first is None:
        want = {t: R for t in tensors}
        return rw.finish(node, want, R), R
    want = {t: first for t in tensors}
    return rw.finish(node, want, first), first


def getitem(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    src, i = args_of(node)
    places = rw.place.get(src)
    out = places[i] if isinstance(places, list) else R
    new = rw.emit(operator.getitem, (rw.env[src], i), place=out)
    rw.set_local_val(new, node, out)
    return new, out


# ------------------------------------------------------------------------------------------ reductions


def _dims_arg(node: Node, n: int, pos: int = 1) -> list[int]:
    dims = args_of(node)[pos] if len(args_of(node)) > pos else node.kwargs.get("dim")
    if dims is None:
        return list(range(n))
    listed: list[Any] = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    return [_nd(d, n) for d in listed] or list(range(n))


def reduction(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """sum/mean/amax over dims (keepdim at arg 2)."""
    x = args_of(node)[0]
    px = rw.p(x)
    n = rw.ndim(x)
    dims = _dims_arg(node, n)
    keep = bool(args_of(node)[2]) if len(args_of(node)) > 2 else bool(node.kwargs.get("keepdim", False))
    is_sum = node.target == aten.sum.dim_IntList
    if px.is_p:
        if is_sum:
            return rw.finish(node, {}, P), P
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
    d = px.dim if keep else px.dim - sum(1 for q in dims if q < px.dim)
    return rw.finish(node, want, S(d)), S(d)


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
    x = args_of(node)[0]
    want = _resolve_partials(rw, node)
    px = want.get(x, rw.p(x))
    normalized = len(args_of(node)[1])
    for a in rw.tensor_inputs(node)[1:]:
        if not rw.p(a).is_r:
            raise TPShardError(f"{fmt(node)}: norm weight {fmt(a)} is sharded ({rw.p(a)}); keep norms replicated")
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
    if t == aten.linear.default:
        x, w = args_of(node)[0], args_of(node)[1]
        b = args_of(node)[2] if len(args_of(node)) > 2 else None
        col_dim, row_dim = 0, 1
    elif t == aten.addmm.default:
        b, x, w = args_of(node)[0], args_of(node)[1], args_of(node)[2]
        col_dim, row_dim = 1, 0
    else:
        x, w = args_of(node)[0], args_of(node)[1]
        b = None
        col_dim, row_dim = 1, 0
    if not isinstance(w, Node) or rw.ndim(w) != 2 or (t == aten.matmul.default and w.op != "get_attr"):
        return batched_matmul(rw, node)
    if t == aten.addmm.default and (node.kwargs or len(args_of(node)) > 3):
        raise TPShardError(f"{fmt(node)}: addmm with beta/alpha is not supported by the tensor-parallel pass")
    pw = rw.p(w)
    last = rw.ndim(x) - 1
    if pw.is_r:
        want = _resolve_partials(rw, node)
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
    return rw.finish(node, {a: R, b: R}, R), R
