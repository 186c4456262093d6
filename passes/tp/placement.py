"""How one value of a tensor-parallel rank graph relates to the value of the single-device graph.

A :class:`Placement` on the tp axis is one of (DTensor's vocabulary, Megatron's semantics):

* ``R``  replicate: every rank holds the full value;
* ``S(d)`` shard: rank ``i`` holds chunk ``i`` of ``tp`` along dim ``d``; with ``parts = k`` the dim
  is first cut into ``k`` equal blocks (fused q|k|v, gate|up) and each block is chunked, so the
  local tensor is the concatenation of chunk ``i`` of every block;
* ``P``  partial sum: the full value is the sum of the ranks' local values (a row-parallel matmul
  output before its all-reduce). ``PD(support, dim)`` is a *disjoint* partial sum: every element
  is non-zero on at most one rank, and that rank is fixed by the element's index along ``dim``
  through the partition named ``support`` (expert-parallel outputs: each token row is computed by
  the rank owning its expert, rows partitioned by one grouped matmul's offsets). So elementwise
  ``f`` with ``f(0) = 0`` may run before the reduction, and two disjoint partials with the same
  support on the same (aligned) dim multiply exactly. An op that moves elements along ``dim``
  (cat, index, a view that merges it) makes the result an ordinary ``P``.

Gradient convention (what makes the inserted collectives correct): the gradient of an ``R`` value
is replicated, of an ``S`` value is the matching shard of the full gradient, and of a ``P`` value is
the full (replicated) gradient of the sum.

The view helper maps a sharded dim through ``view``/``reshape`` (a worked picture)::

    [b, t, h*d]  S(2)  --view-->  [b, t, h, d]   S(2)   splits the sharded dim; needs h % tp == 0
    [b, t, h, d] S(2)  --view-->  [b, t, h*d]    S(2)   merges with the sharded dim outermost: ok
    [b, t, e]    S(1)  --view-->  [b*t, e]              t is not outermost of (b, t): not a shard
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Sequence

__all__ = ["Placement", "R", "P", "PD", "S", "map_view_dim", "partial_moved", "same_dim"]


@dataclass(frozen=True)
class Placement:
    """Placement of one tensor value on the tp axis (see the module docstring)."""

    kind: str
    """``"R"``, ``"S"`` or ``"P"``."""
    dim: int = -1
    """For ``S``: the sharded dim, non-negative. For a disjoint ``P``: the dim whose index picks the rank."""
    parts: int = 1
    """For ``S``: fused blocks along ``dim`` that are chunked separately."""
    disjoint: str = ""
    """For ``P``: non-empty when each element is non-zero on at most one rank; names the partition
    (values with the same name are non-zero on the same rank)."""

    @property
    def is_r(self) -> bool:
        return self.kind == "R"

    @property
    def is_s(self) -> bool:
        return self.kind == "S"

    @property
    def is_p(self) -> bool:
        return self.kind == "P"

    def __str__(self) -> str:
        if self.kind == "S":
            return f"S({self.dim})" if self.parts == 1 else f"S({self.dim},parts={self.parts})"
        if self.kind == "P" and self.disjoint:
            return "P(disjoint)"
        return self.kind


R = Placement("R")
P = Placement("P")


def PD(support: str, dim: int) -> Placement:  # noqa: N802 - reads like the notation
    """A disjoint partial sum whose elements' rank is given by their index along ``dim`` through the
    partition ``support``."""
    return Placement("P", dim=dim, disjoint=support)


def partial_moved(place: Placement, dim: int | None) -> Placement:
    """The partial sum ``place`` after a linear op that moves its owner dim to ``dim``: a disjoint
    partial stays disjoint on the new dim, or becomes an ordinary ``P`` when the op loses the dim
    (None: it merged, cut or reordered the owner dim)."""
    if place.disjoint and dim is not None:
        return PD(place.disjoint, dim)
    return P


def S(dim: int, parts: int = 1) -> Placement:  # noqa: N802 - reads like the notation
    return Placement("S", dim=dim, parts=parts)


def local_shape(shape: Sequence[int], place: Placement, tp: int) -> list[int]:
    """The rank-local shape of a value of global ``shape`` placed as ``place``."""
    out = list(shape)
    if place.is_s:
        out[place.dim] //= tp
    return out


def map_view_dim(in_shape: Sequence[int], out_shape: Sequence[int], dim: int, tp: int,
                 parts: int = 1) -> tuple[int | None, str]:
    """Where the sharded ``dim`` of ``in_shape`` lands after a view to ``out_shape``.

    Returns ``(out_dim, "")`` when the view of the local chunk is the chunk of the view, or
    ``(None, why)`` when it is not (the caller gathers first, or raises where gathering would hide
    a plan error, such as heads that do not divide by tp).
    """
    n = in_shape[dim]
    pre = prod(in_shape[:dim])
    acc = 1
    for k, size in enumerate(out_shape):
        if acc == pre and size != 1:
            if size == n:
                return k, ""
            if parts != 1:
                return None, f"the fused dim {dim} (size {n}, {parts} blocks) is reshaped to {size}"
            if size > n:
                if size % n == 0 and prod(in_shape[:dim + 1]) * (size // n) == prod(out_shape[:k + 1]):
                    return k, ""  # sharded dim is the outermost of a merged group
                return None, f"dim {dim} (size {n}) is merged with inner dims in an unsupported way"
            # size < n: the sharded dim is split into (size, n // size, ...)
            if n % size:
                return None, f"dim {dim} (size {n}) is not split evenly into {size}"
            if size % tp:
                return None, (f"view splits the sharded dim {dim} (size {n}) into {size} x {n // size}; "
                              f"{size} does not divide by tp={tp}")
            return k, ""
        acc *= size
        if acc > pre:
            break
    return None, (f"the sharded dim {dim} of {list(in_shape)} is merged with an outer dim in "
                  f"{list(out_shape)}, so the local chunk is not a chunk of the result")


def same_dim(in_shape: Sequence[int], out_shape: Sequence[int], dim: int) -> int | None:
    """The dim of ``out_shape`` that is ``in_shape``'s ``dim`` unchanged (same size, same elements
    before it) after a view, or None."""
    pre = prod(in_shape[:dim])
    acc = 1
    for k, size in enumerate(out_shape):
        if acc == pre and size == in_shape[dim] and size != 1:
            return k
        acc *= size
        if acc > pre:
            break
    return None
