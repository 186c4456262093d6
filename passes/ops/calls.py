"""The one table of the run-time calls passes insert into rank graphs that talk to other ranks:
each function, its name, the position of its axis-name argument and the pass that inserts it.

``passes.verify`` checks every such call names its axis; the tensor-parallel pass counts its own
(``passes.tp.shard_tensor_parallel.collective_counts``). A new collective op is added here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from passes.ops import bn_ops, comm, ep_ops, tp_ops

__all__ = ["GraphCall", "CALLS", "calls_of"]


@dataclass(frozen=True)
class GraphCall:
    """A run-time op a pass inserts."""

    name: str
    """How reports and tests name it (``copy_to_group``)."""
    axis_arg: int | None
    """Position of its axis-name argument (``'tp'``, ``'ep'``, ``'dp'``); None: it takes no axis."""
    inserted_by: str
    """The pass that inserts it: ``tp``, ``ep`` or ``bn`` (batch norm)."""
    collective: bool = True
    """It communicates; False for the tensor-parallel pass's local ops, counted with its collectives."""


CALLS: dict[Any, GraphCall] = {
    comm.copy_to_group: GraphCall("copy_to_group", 1, "tp"),
    comm.reduce_from_group: GraphCall("reduce_from_group", 1, "tp"),
    comm.gather_from_group: GraphCall("gather_from_group", 1, "tp"),
    comm.scatter_to_group: GraphCall("scatter_to_group", 1, "tp"),
    comm.gather_seq: GraphCall("gather_seq", 1, "tp"),
    comm.reduce_scatter_seq: GraphCall("reduce_scatter_seq", 1, "tp"),
    tp_ops.vocab_parallel_cross_entropy: GraphCall("vocab_parallel_cross_entropy", 2, "tp"),
    tp_ops.vocab_parallel_embedding: GraphCall("vocab_parallel_embedding", None, "tp", collective=False),
    tp_ops.expert_grouped_mm: GraphCall("expert_grouped_mm", None, "tp", collective=False),
    tp_ops.local_chunk: GraphCall("local_chunk", 1, "tp", collective=False),
    ep_ops.moe_dispatch: GraphCall("moe_dispatch", 2, "ep"),
    ep_ops.moe_combine: GraphCall("moe_combine", 2, "ep"),
    bn_ops.batch_norm_sync: GraphCall("batch_norm_sync", 8, "bn"),
    bn_ops.instance_norm_sync: GraphCall("instance_norm_sync", 7, "bn"),
}
"""Function -> what it is. (The data-parallel ops take a bucket or unit handle, which names its axis.)"""


def calls_of(inserted_by: str, *, collective: bool | None = None) -> dict[Any, str]:
    """Function -> name of the calls one pass inserts (only collectives, or only local ops, if asked)."""
    return {f: c.name for f, c in CALLS.items()
            if c.inserted_by == inserted_by and (collective is None or c.collective == collective)}
