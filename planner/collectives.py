"""Wire bytes of each collective: the one table the cost model and the run-time counter both read.

Per rank, for a group of ``n`` ranks and a tensor of ``nbytes`` (the full, unsharded tensor for
all-gather and reduce-scatter; one rank's send buffer for all-to-all), the ring algorithms send::

    all_reduce       2(n-1)/n · nbytes     (reduce-scatter, then all-gather)
    all_gather       (n-1)/n · nbytes
    reduce_scatter   (n-1)/n · nbytes
    all_to_all       (n-1)/n · nbytes      (keeps 1/n, sends the rest, one peer per round)
    broadcast        nbytes
    send / recv      nbytes

Sources: Patarasuk & Yuan 2009 ("Bandwidth optimal all-reduce algorithms for clusters of
workstations"), Thakur, Rabenseifner & Gropp 2005 ("Optimization of Collective Communication
Operations in MPICH", Table 1); the same factors turn nccl-tests' times into bus bandwidth.
Dependency-free: ``planner.cost_comm`` (times and volumes) and ``passes.ops.comm`` (the counter of
what each collective moved) import it.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["WIRE_FACTOR", "wire_factor", "wire_bytes"]

WIRE_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}
"""Collective kind -> the share of ``nbytes`` one rank sends, as a function of the group size."""


def wire_factor(kind: str, n: int) -> float:
    """Bytes one rank sends per byte of the collective's tensor (0 on a group of one)."""
    if kind not in WIRE_FACTOR:
        raise ValueError(f"unknown collective kind {kind!r}; known: {sorted(WIRE_FACTOR)}")
    return WIRE_FACTOR[kind](n) if n > 1 else 0.0


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ``kind`` collective over ``n`` ranks on a tensor of ``nbytes``."""
    return wire_factor(kind, n) * nbytes
