"""Alpha-beta times and volumes of collectives. Pure arithmetic, no process groups.

Conventions: ``nbytes`` is the size of the full tensor being reduced or gathered (for all-gather,
the gathered result; for reduce-scatter, the unreduced input; for all-to-all, one rank's send
buffer); ``n`` is the group size; ``bandwidth`` is the achieved per-rank, per-direction bandwidth
in bytes/s of the slowest link the group crosses (link rate × network efficiency); ``latency``
is that link's per-message latency in seconds. Times are seconds, volumes are bytes a rank sends.

Source of every formula: the ring algorithms of Patarasuk & Yuan 2009 ("Bandwidth optimal
all-reduce algorithms for clusters of workstations") and the alpha-beta costs tabulated in
Thakur, Rabenseifner & Gropp 2005 ("Optimization of Collective Communication Operations in
MPICH", Table 1), which are also what nccl-tests uses to turn times into bus bandwidth.
"""

from __future__ import annotations

__all__ = ["all_reduce_time", "all_gather_time", "reduce_scatter_time", "all_to_all_time", "p2p_time",
           "all_reduce_volume", "all_gather_volume", "reduce_scatter_volume", "all_to_all_volume"]


def all_reduce_time(nbytes: float, n: int, *, bandwidth: float, latency: float) -> float:
    """Ring all-reduce: ``2(n-1)·α + 2(n-1)/n · nbytes/β`` seconds (reduce-scatter then all-gather)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth


def all_gather_time(nbytes: float, n: int, *, bandwidth: float, latency: float) -> float:
    """Ring all-gather of a result of ``nbytes``: ``(n-1)·α + (n-1)/n · nbytes/β`` seconds."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * latency + (n - 1) / n * nbytes / bandwidth


def reduce_scatter_time(nbytes: float, n: int, *, bandwidth: float, latency: float) -> float:
    """Ring reduce-scatter of an input of ``nbytes``: ``(n-1)·α + (n-1)/n · nbytes/β`` seconds."""
    return all_gather_time(nbytes, n, bandwidth=bandwidth, latency=latency)


def all_to_all_time(nbytes: float, n: int, *, bandwidth: float, latency: float) -> float:
    """Pairwise all-to-all of a send buffer of ``nbytes`` per rank: ``(n-1)·α + (n-1)/n · nbytes/β``
    seconds (each rank keeps 1/n and sends the other (n-1)/n, one peer per round)."""
    return all_gather_time(nbytes, n, bandwidth=bandwidth, latency=latency)


def p2p_time(nbytes: float, *, bandwidth: float, latency: float) -> float:
    """One send/recv of ``nbytes``: ``α + nbytes/β`` seconds."""
    if nbytes <= 0:
        return 0.0
    return latency + nbytes / bandwidth


def all_reduce_volume(nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce: ``2(n-1)/n · nbytes``."""
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def all_gather_volume(nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-gather (or reduce-scatter) of ``nbytes``: ``(n-1)/n · nbytes``."""
    return (n - 1) / n * nbytes if n > 1 else 0.0


reduce_scatter_volume = all_gather_volume
all_to_all_volume = all_gather_volume
