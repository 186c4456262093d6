"""The rules of :mod:`planner.row_flow` for ops that move or cut dims: where the batch's dim goes."""

from __future__ import annotations

from math import prod

import torch
import torch.fx

from planner.row_rules import (Rows, Rule, State, Unproven, args, broadcast_free, kwargs_of, norm_dim, op_name, rows_of,
                               same_as_first, shape_of, state_of)

__all__ = ["SHAPE_RULES"]


def _reshape(node: torch.fx.Node, states: dict[str, State]) -> State:
    """Row ``r``'s elements in the row-major order of the input are those whose index along
    ``dim`` lies in ``[r·block, (r+1)·block)``: in the output they are the slices ``i // block'``
    of one dim ``e`` exactly when that dim's span equals the input's cycle of rows along ``dim``
    (size × stride) and the dims inside ``e`` fit in one row's run (their span divides block ×
    stride)."""
    rows = same_as_first(node, states)
    if rows is None:
        return None
    src, out = shape_of(args(node)[0]), shape_of(node)
    stride = prod(src[rows.dim + 1:])
    cycle, run = src[rows.dim] * stride, rows.block * stride
    for e in range(len(out)):
        inner = prod(out[e + 1:])
        if out[e] * inner == cycle and inner and run % inner == 0:
            return Rows(e, run // inner)
    raise Unproven(node, f"a reshape {src} -> {out} that spreads rows across dims")


def _transpose(node: torch.fx.Node, states: dict[str, State]) -> State:
    rows = same_as_first(node, states)
    if rows is None:
        return None
    ndim = len(shape_of(args(node)[0]))
    name = op_name(node)
    if name == "permute":
        order = [norm_dim(int(d), ndim) for d in args(node)[1]]
    else:
        order = list(range(ndim))
        if name == "t":
            a, b = (0, 1) if ndim == 2 else (0, 0)
        else:
            a, b = norm_dim(int(args(node)[1]), ndim), norm_dim(int(args(node)[2]), ndim)
        order[a], order[b] = order[b], order[a]
    return Rows(order.index(rows.dim), rows.block)


def _unsqueeze(node: torch.fx.Node, states: dict[str, State]) -> State:
    rows = same_as_first(node, states)
    if rows is None:
        return None
    at = norm_dim(int(args(node)[1]), len(shape_of(node)))
    return Rows(rows.dim + 1 if at <= rows.dim else rows.dim, rows.block)


def _squeeze(node: torch.fx.Node, states: dict[str, State]) -> State:
    rows = same_as_first(node, states)
    if rows is None:
        return None
    src = shape_of(args(node)[0])
    dims = args(node)[1] if len(args(node)) > 1 else None
    dims = [dims] if isinstance(dims, int) else dims
    gone = {norm_dim(int(d), len(src)) for d in dims} if dims is not None else set(range(len(src)))
    gone = {d for d in gone if src[d] == 1}
    if rows.dim in gone:
        raise Unproven(node, "it squeezes the batch's dim")
    return Rows(rows.dim - sum(1 for d in gone if d < rows.dim), rows.block)


def _expand(node: torch.fx.Node, states: dict[str, State]) -> State:
    rows = same_as_first(node, states)
    if rows is None:
        return None
    src, out = shape_of(args(node)[0]), shape_of(node)
    at = rows.dim + len(out) - len(src)
    if out[at] != src[rows.dim]:
        raise Unproven(node, "it expands the batch's dim")
    return Rows(at, rows.block)


def _along(node: torch.fx.Node, states: dict[str, State]) -> State:
    """slice / select / split / narrow / pad / index_select / cat: fine along any dim but the batch's."""
    name = op_name(node)
    if name == "cat":
        return _cat(node, states)
    rows = same_as_first(node, states) if name not in ("index_select",) else rows_of(node, args(node)[0], states)
    if rows is None:
        return None
    src = shape_of(args(node)[0])
    if name == "index_select" and state_of(args(node)[2], states) is not None:
        raise Unproven(node, "an index that depends on the batch")
    if name in ("pad", "constant_pad_nd"):
        padded = len(args(node)[1]) // 2
        if rows.dim >= len(src) - padded:
            raise Unproven(node, "it pads the batch's dim")
        return rows
    splits = name in ("split", "split_with_sizes", "chunk", "unsafe_split")  # (self, sizes, dim=0)
    at = 2 if splits else 1
    dim = norm_dim(int(args(node)[at] if len(args(node)) > at else kwargs_of(node).get("dim", 0)), len(src))
    if splits:
        if dim == rows.dim:
            raise Unproven(node, f"{name} along the batch's dim")
        val = node.meta.get("val")
        return tuple(rows for _ in (val if isinstance(val, (list, tuple)) else [val]))
    if dim == rows.dim and not (name == "slice" and _whole(args(node), src[dim])):
        raise Unproven(node, f"{name} along the batch's dim")
    if name == "select":
        return Rows(rows.dim - (1 if dim < rows.dim else 0), rows.block)
    return rows


def _stack(node: torch.fx.Node, states: dict[str, State]) -> State:
    parts = list(args(node)[0])
    out = shape_of(node)
    dim = norm_dim(int(args(node)[1] if len(args(node)) > 1 else kwargs_of(node).get("dim", 0)), len(out))
    kinds = {rows_of(node, p, states) for p in parts} - {None}
    if len(kinds) != 1 or any(state_of(p, states) is None for p in parts):
        raise Unproven(node, "the parts hold the batch differently, or a batch-free part is among them")
    rows = next(k for k in kinds if k is not None)
    return Rows(rows.dim + 1 if dim <= rows.dim else rows.dim, rows.block)


def _whole(given: tuple[object, ...], size: int) -> bool:
    """Whether ``slice(self, dim, start, end, step)`` keeps every index (``x[:, 1:]`` slices dim 0 whole first)."""
    start, end, step = (list(given[2:5]) + [None, None, None])[:3]
    return start in (0, None) and (end is None or isinstance(end, int) and end >= size) and step in (1, None)


def _cat(node: torch.fx.Node, states: dict[str, State]) -> State:
    parts = list(args(node)[0])
    dim = args(node)[1] if len(args(node)) > 1 else kwargs_of(node).get("dim", 0)
    out = shape_of(node)
    dim = norm_dim(int(dim), len(out))
    kinds = {rows_of(node, p, states) for p in parts} - {None}
    if len(kinds) != 1:
        raise Unproven(node, "the parts hold the batch differently")
    rows = next(k for k in kinds if k is not None)
    if rows.dim == dim:
        raise Unproven(node, "cat along the batch's dim")
    if any(state_of(p, states) is None and prod(shape_of(p)) and not broadcast_free(p, rows.dim, len(out))
           for p in parts):  # row i would get the part's i-th slice (a class token expanded to the batch is one value)
        raise Unproven(node, "a batch-free part beside the batch's rows")
    return rows




SHAPE_RULES: dict[str, Rule] = {
    "view": _reshape, "reshape": _reshape, "_unsafe_view": _reshape, "flatten": _reshape, "unflatten": _reshape,
    "transpose": _transpose, "permute": _transpose, "t": _transpose,
    "unsqueeze": _unsqueeze, "squeeze": _squeeze, "expand": _expand,
    "slice": _along, "select": _along, "split": _along, "split_with_sizes": _along, "chunk": _along,
    "unsafe_split": _along, "narrow": _along, "pad": _along, "constant_pad_nd": _along, "index_select": _along,
    "cat": _along, "stack": _stack,
}
"""ATen op -> its rule, for the ops that move or cut dims."""
