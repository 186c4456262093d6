"""How one value of a tensor-parallel rank graph relates to the value of the single-device graph.

A :class:`Placement` on the tp axis is one of (DTensor's vocabulary, Megatron's semantics):

* ``R``  replicate: every rank holds the full value;
* ``S(d)`` shard: rank ``i`` holds chunk ``i`` of ``tp`` along dim ``d``; with ``parts = k`` the dim
  is first cut into ``k`` equal blocks (fused q|k|v, gate|up) and each block is chunked, so the
  local tensor is the concatenation of chunk ``i`` of every block;
* ``P``  partial sum: the full value is the sum of the ranks' local values (a row-parallel matmul
  output before its all-reduce). ``P`` with ``disjoint=True`` additionally says that every element
  is non-zero on at most one rank (expert-parallel outputs: each token row is computed by the rank
  owning its expert), so elementwise ``f`` with ``f(0) = 0`` may be applied before the reduction.

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

__all__ = ["Placement", "R", "P", "PD", "S", "map_view_dim"]


@dataclass(frozen=True)
class Placement:
    """Placement of one tensor value on the tp axis (see the module docstring)."""

    kind: str
    """``"R"``, ``"S"`` or ``"P"``."""
    dim: int = -1
    """For ``S``: the sharded dim, non-negative."""
    parts: int = 1
    """For ``S``: fused blocks along ``dim`` that are chunked separately."""
    disjoint: bool = False
    """For ``P``: each element is non-zero on at most one rank."""

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
PD = Placement("P", disjoint=True)


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
