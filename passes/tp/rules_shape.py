"""Sharding rules of ``shard_tensor_parallel_pass`` for ops that move or cut dims: views, flatten /
unflatten, expand, transpose / permute / (un)squeeze, slice / select, split / chunk, cat, getitem.
A view of a shard is a shard of the view when the sharded dim stays outermost of its group
(``passes.tp.placement.map_view_dim``); otherwise the input is gathered first. Partial sums pass
through every op here unchanged: they are all linear.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch.fx import Node

from passes.tp.placement import Placement, P, R, S, local_shape, map_view_dim, partial_moved, same_dim
from passes.tp.rewrite import Rewriter, TPShardError, args_of, fmt
from passes.tp.rules import _nd, _resolve_partials

aten = torch.ops.aten


def _view_of_shard(rw: Rewriter, node: Node, x: Node, px: Placement) -> Placement | None:
    """Where ``x``'s shard ``px`` lands in ``node``'s output (a view-like op), or None: gather it.
    Raises when gathering would hide a plan error (heads that do not divide by tp)."""
    k, why = map_view_dim(rw.shape(x), rw.shape(node), px.dim, rw.tp, px.parts)
    if k is None:
        if "does not divide by tp" in why or px.parts != 1 and "fused" in why:
            raise TPShardError(f"cannot shard {fmt(node)}: {why} (input {fmt(x)} is {px}). "
                               "With attention, the number of (key/value) heads must divide by tp")
        return None
    return S(k, px.parts)


def _view_of_other(rw: Rewriter, node: Node, x: Node, px: Placement) -> tuple[Node, Any]:
    """A view of a replicated value or of a partial sum (views are linear); a disjoint partial keeps
    its owner dim when the view leaves that dim whole."""
    out = px
    if px.is_p:
        out = partial_moved(px, same_dim(rw.shape(x), rw.shape(node), px.dim) if px.disjoint else None)
    return rw.finish(node, {}, out), out


def view(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """view / reshape / _unsafe_view (x, shape): the shape argument becomes the local shape."""
    x = args_of(node)[0]
    px = rw.p(x)
    if not px.is_s:
        return _view_of_other(rw, node, x, px)
    out = _view_of_shard(rw, node, x, px)
    if out is None:
        return rw.finish(node, {x: R}, R), R
    return rw.finish(node, {}, out, args=(x, local_shape(rw.shape(node), out, rw.tp), *args_of(node)[2:])), out


def flatten(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """flatten.using_ints (x, start_dim, end_dim): dims, not sizes, so the arguments stay."""
    x = args_of(node)[0]
    px = rw.p(x)
    if not px.is_s:
        return _view_of_other(rw, node, x, px)
    out = _view_of_shard(rw, node, x, px)
    if out is None:
        return rw.finish(node, {x: R}, R), R
    return rw.finish(node, {}, out), out


def unflatten(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """unflatten.int (x, dim, sizes): the sizes become the local sizes of the new dims."""
    x = args_of(node)[0]
    px = rw.p(x)
    if not px.is_s:
        return _view_of_other(rw, node, x, px)
    out = _view_of_shard(rw, node, x, px)
    if out is None:
        return rw.finish(node, {x: R}, R), R
    dim = _nd(args_of(node)[1], rw.ndim(x))
    count = len(args_of(node)[2])
    sizes = local_shape(rw.shape(node), out, rw.tp)[dim:dim + count]
    return rw.finish(node, {}, out, args=(x, args_of(node)[1], sizes)), out


def view_dtype(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """view.dtype (x, dtype): a bitcast. A shard stays a shard when its dim still divides by tp (the
    last dim scales by the item-size ratio, bytes stay in order); a partial sum does not survive it."""
    x = args_of(node)[0]
    px = rw.p(x)
    if px.is_p:
        return rw.finish(node, {x: R}, R), R
    if px.is_s and px.parts == 1 and rw.shape(node)[px.dim] % rw.tp == 0:
        return rw.finish(node, {}, px), px
    return rw.finish(node, {x: R} if px.is_s else {}, R), R


def expand(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    x = args_of(node)[0]
    px = rw.p(x)
    shift = rw.ndim(node) - rw.ndim(x)
    if px.is_p:
        keep = px.dim >= 0 and rw.shape(node)[px.dim + shift] == rw.shape(x)[px.dim]
        out_p = partial_moved(px, px.dim + shift if keep else None)
        return rw.finish(node, {}, out_p), out_p
    if not px.is_s:
        return rw.finish(node, {}, px), px
    out = S(px.dim + shift, px.parts)
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
    if px.is_p:
        out_p = partial_moved(px, _dim_map(rw, node)(px.dim) if px.disjoint else None)
        return rw.finish(node, {}, out_p), out_p
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
    if px.is_p:  # slicing and selecting are linear; they keep a disjoint partial's owner dim unless they cut it
        keep = px.disjoint and dim != px.dim
        out_p = partial_moved(px, (px.dim - (1 if node.target == aten.select.int and dim < px.dim else 0))
                              if keep else None)
        return rw.finish(node, {}, out_p), out_p
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
    if px.is_p:  # linear; a disjoint partial split along its owner dim is an ordinary partial
        part = partial_moved(px, px.dim if px.disjoint and dim != px.dim else None)
        return rw.finish(node, {}, [part] * count), [part] * count
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
    tensors = list(args_of(node)[0])
    dim_arg = args_of(node)[1] if len(args_of(node)) > 1 else node.kwargs.get("dim", 0)
    dim = _nd(int(dim_arg), rw.ndim(node))  # type: ignore[arg-type]
    # torch.cat skips 1-D empty tensors whatever the others' rank (an empty KV cache: cat([empty, k], -2)):
    # they contribute nothing and stay as they are
    real = [t for t in tensors if not _legacy_empty(rw, t, rw.ndim(node))]
    places = [rw.p(t) for t in real]
    if places and all(p.is_p for p in places):
        return rw.finish(node, {}, P), P  # a concatenation of partial sums is the partial sum of the concatenation
    first = next((p for p in places if p.is_s and p.dim != dim and p.parts == 1), None)
    if first is None:
        want = {t: R for t in real}
        return rw.finish(node, want, R), R
    want = {t: first for t in real}
    return rw.finish(node, want, first), first


def _legacy_empty(rw: Rewriter, t: Any, ndim: int) -> bool:
    return isinstance(t, Node) and rw.is_tensor(t) and ndim != 1 and list(rw.shape(t)) == [0]


def getitem(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    src, i = args_of(node)
    places = rw.place.get(src)
    out = places[i] if isinstance(places, list) else R
    new = rw.emit(operator.getitem, (rw.env[src], i), place=out)
    rw.set_local_val(new, node, out)
    return new, out


