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

from dataclasses import dataclass

from planner.cluster import Cluster, link_at
from planner.collectives import wire_bytes

__all__ = ["all_reduce_time", "all_gather_time", "reduce_scatter_time", "all_to_all_time", "p2p_time",
           "all_reduce_volume", "all_gather_volume", "reduce_scatter_volume", "all_to_all_volume",
           "Group", "comm_group", "group_all_reduce_time", "group_all_gather_time", "group_reduce_scatter_time",
           "group_all_to_all_time", "group_all_reduce_volume", "group_all_gather_volume"]


def all_reduce_time(nbytes: float, n: int, *, bandwidth: float, latency: float) -> float:
    """Ring all-reduce: ``2(n-1)·α + 2(n-1)/n · nbytes/β`` seconds (reduce-scatter then all-gather)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * latency + wire_bytes("all_reduce", nbytes, n) / bandwidth


def all_gather_time(nbytes: float, n: int, *, bandwidth: float, latency: float) -> float:
    """Ring all-gather of a result of ``nbytes``: ``(n-1)·α + (n-1)/n · nbytes/β`` seconds."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * latency + wire_bytes("all_gather", nbytes, n) / bandwidth


def reduce_scatter_time(nbytes: float, n: int, *, bandwidth: float, latency: float) -> float:
    """Ring reduce-scatter of an input of ``nbytes``: ``(n-1)·α + (n-1)/n · nbytes/β`` seconds."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * latency + wire_bytes("reduce_scatter", nbytes, n) / bandwidth


def all_to_all_time(nbytes: float, n: int, *, bandwidth: float, latency: float) -> float:
    """Pairwise all-to-all of a send buffer of ``nbytes`` per rank: ``(n-1)·α + (n-1)/n · nbytes/β``
    seconds (each rank keeps 1/n and sends the other (n-1)/n, one peer per round)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * latency + wire_bytes("all_to_all", nbytes, n) / bandwidth


def p2p_time(nbytes: float, *, bandwidth: float, latency: float) -> float:
    """One send/recv of ``nbytes``: ``α + nbytes/β`` seconds."""
    if nbytes <= 0:
        return 0.0
    return latency + nbytes / bandwidth


def all_reduce_volume(nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce: ``2(n-1)/n · nbytes`` (``planner.collectives``)."""
    return wire_bytes("all_reduce", nbytes, n)


def all_gather_volume(nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-gather (or reduce-scatter) of ``nbytes``: ``(n-1)/n · nbytes``."""
    return wire_bytes("all_gather", nbytes, n)


reduce_scatter_volume = all_gather_volume
all_to_all_volume = all_gather_volume


# --- groups laid out on a two-level cluster ------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """A communication group as the cluster places it: ``size`` ranks, ``per_node`` of them in each
    node, NVLink-class links inside a node and NIC links between nodes. Bandwidths are achieved
    per-rank, per-direction rates (link rate × network efficiency), latencies per message.

    Collectives on it are hierarchical (the two-level algorithms of Thakur et al. 2005 §4 and
    NCCL's trees/rings over rails): a reduction first reduce-scatters inside each node, then the
    ``per_node`` ranks of a node each all-reduce their ``1/per_node`` slice with their peers in the
    other nodes over their own NIC, then all-gather inside the node. So an inter-node step carries
    ``1/per_node`` of the bytes and pays ``(nodes - 1)`` latencies, not the flat ring's ``(size - 1)``.
    """

    size: int
    """Ranks in the group."""
    per_node: int
    """Ranks of the group inside one node (``size`` when the group fits in a node)."""
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    intra_links: tuple[tuple[str, tuple[tuple[float, float, float], ...]], ...] = ()
    """(collective, its :meth:`Cluster.link_rows`) inside a node where it differs from the intra
    link (measured per op, or per op and size range, by calibration; × network efficiency)."""

    def intra(self, op: str, nbytes: float) -> tuple[float, float]:
        """(bandwidth, latency) of collective ``op`` of a message of ``nbytes`` inside a node."""
        for name, rows in self.intra_links:
            if name == op:
                return link_at(rows, nbytes)
        return self.intra_bandwidth, self.intra_latency

    @property
    def nodes(self) -> int:
        """Nodes the group spans."""
        return -(-self.size // self.per_node)


def comm_group(cluster: Cluster, size: int, stride: int = 1) -> Group:
    """The group of ``size`` ranks spaced ``stride`` apart (a dp group has stride tp, an ep group
    stride tp, a pp group stride tp·dp) on ``cluster``: how many share a node, and the links."""
    per = cluster.devices_per_node
    inside = max(1, per // stride) if stride < per else 1
    eff = cluster.efficiency.network
    return Group(size=max(1, size), per_node=max(1, min(size, inside)),
                 intra_bandwidth=cluster.intra_bandwidth * eff, intra_latency=cluster.intra_latency,
                 inter_bandwidth=cluster.inter_bandwidth * eff, inter_latency=cluster.inter_latency,
                 intra_links=tuple((op, cluster.link_rows(op))
                                   for op in sorted({*cluster.collective_links, *cluster.collective_ranges})))


def group_all_reduce_time(g: Group, nbytes: float) -> float:
    """Hierarchical all-reduce of ``nbytes``: intra-node reduce-scatter, inter-node all-reduce of
    ``nbytes/per_node`` over ``nodes``, intra-node all-gather (one flat ring when the group fits in
    a node). Example: 1 GB over 16 ranks = 2 nodes × 8 at 240/20 GB/s: 2·(7/8)·1e9/240e9 +
    2·(1/2)·(1e9/8)/20e9 = 7.3 ms + 6.3 ms (+ latencies), against a flat ring's 2·(15/16)·1e9/20e9 = 94 ms."""
    k, n = g.per_node, g.nodes
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    intra = all_reduce_time(nbytes, k, bandwidth=g.intra_bandwidth, latency=g.intra_latency)
    if n == 1:
        return intra
    return intra + all_reduce_time(nbytes / k, n, bandwidth=g.inter_bandwidth, latency=g.inter_latency)


def group_all_gather_time(g: Group, nbytes: float, *, op: str = "all_gather") -> float:
    """Hierarchical all-gather of a result of ``nbytes`` (reduce-scatter is its mirror image): the
    inter-node step gathers ``nbytes/per_node`` over ``nodes``, the intra-node step the whole, on
    ``op``'s own intra-node link where the cluster measured one (``Group.intra``)."""
    k, n = g.per_node, g.nodes
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = g.intra(op, nbytes)
    intra = all_gather_time(nbytes, k, bandwidth=bandwidth, latency=latency)
    if n == 1:
        return intra
    return intra + all_gather_time(nbytes / k, n, bandwidth=g.inter_bandwidth, latency=g.inter_latency)


def group_reduce_scatter_time(g: Group, nbytes: float) -> float:
    """Hierarchical reduce-scatter of an input of ``nbytes``: :func:`group_all_gather_time`'s mirror
    image, on the reduce-scatter's own intra-node link where the cluster measured one."""
    return group_all_gather_time(g, nbytes, op="reduce_scatter")


def group_all_to_all_time(g: Group, nbytes: float) -> float:
    """All-to-all of a send buffer of ``nbytes`` per rank: ``1/size`` stays, the ``per_node - 1``
    shares for the rank's node go over NVLink and the ``size - per_node`` others over its NIC
    (each peer one message)."""
    k, n = g.per_node, g.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    share = nbytes / n
    return ((k - 1) * (g.intra_latency + share / g.intra_bandwidth)
            + (n - k) * (g.inter_latency + share / g.inter_bandwidth))


def group_all_reduce_volume(g: Group, nbytes: float) -> float:
    """Bytes one rank sends in :func:`group_all_reduce_time`: ``2(k-1)/k·S + 2(N-1)/N·S/k``."""
    if g.size <= 1:
        return 0.0
    k, n = g.per_node, g.nodes
    return all_reduce_volume(nbytes, k) + all_reduce_volume(nbytes / k, n)


def group_all_gather_volume(g: Group, nbytes: float) -> float:
    """Bytes one rank sends in :func:`group_all_gather_time` (or a reduce-scatter)."""
    if g.size <= 1:
        return 0.0
    k, n = g.per_node, g.nodes
    return all_gather_volume(nbytes, k) + all_gather_volume(nbytes / k, n)
