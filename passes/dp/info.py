"""The record the data-parallel pass leaves on a rank graph (``gm.meta["fs_dp"]``), read by the
optimizer, state dicts, checkpoints and memory accounting: what was bucketed or flattened, where
its tensors live, and which parameters stayed whole. A leaf: the runtime imports it, not the pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch import nn

from passes.ops.dp_ops import DDPBucket, FSDPUnit
from planner.plan import DataParallel

__all__ = ["META_DP", "DataParallelInfo", "Placement", "ExpertGroup", "dp_info", "find_dp_info"]


@dataclass(frozen=True)
class Placement:
    """Where a data-parallel rank graph's tensors live.

    ``compute``: parameters as the graph reads them, gathered FSDP buffers, gradients in flight,
    buffers and the tensors graph nodes create. ``store``: the tensors the optimizer steps (master
    shards) and so its state; the host when ``data_parallel.offload`` is set, else ``compute``.
    ``pin``: the store is page-locked host memory, so copies to and from a CUDA ``compute`` run
    asynchronously (only meaningful, and only possible, with a CUDA device).
    """

    compute: torch.device
    store: torch.device
    pin: bool = False

    def store_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed 1-D tensor on the store (pinned when the store is pinned)."""
        return torch.zeros(numel, dtype=dtype, device=self.store, pin_memory=self.pin)


META_DP = "fs_dp"
"""gm.meta key holding the rank's :class:`DataParallelInfo`."""


@dataclass
class DataParallelInfo:
    """What the data-parallel pass did, for the optimizer, state dicts and reports."""

    kind: str
    """ddp, zero1, zero2 or fsdp."""
    axis: str
    dp_index: int
    dp_size: int
    config: DataParallel
    buckets: list[DDPBucket] = field(default_factory=list)
    """ddp/zero: gradient buckets in backward (reduction) order."""
    units: list[FSDPUnit] = field(default_factory=list)
    """fsdp: units in forward order."""
    aliases: dict[str, list[str]] = field(default_factory=dict)
    """Tied parameters: the key the rank holds -> the user's other keys for the same tensor."""
    replicated: dict[str, str] = field(default_factory=dict)
    """attr -> user key of parameters kept whole on every rank (all of them for ddp/zero; frozen
    ones for fsdp)."""
    placement: Placement = field(default_factory=lambda: Placement(torch.device("cpu"), torch.device("cpu")))
    """Where the graph computes and where the optimizer's tensors live (``passes.dp.graph.Placement``)."""

    def plain_params(self) -> list[nn.Parameter]:
        """Trainable parameters kept whole and all-reduced (every parameter for ddp; for the
        sharded kinds, those compiled with ``replicate=``); a plain optimizer steps them."""
        return [p for b in self.buckets if b.kind == "ddp" for p in b.params]

    def sharded_params(self) -> list[nn.Parameter]:
        """The tensors a sharded optimizer steps (zero: bucket shards; fsdp: unit flats)."""
        if self.kind == "fsdp":
            return [u.flat for u in self.units]
        if self.kind in ("zero1", "zero2"):
            return [b.shard for b in self.buckets if b.shard is not None]
        return []


def dp_info(gm: torch.nn.Module) -> DataParallelInfo:
    """The :class:`DataParallelInfo` of a rank graph; says which pass is missing when there is none."""
    info = find_dp_info(gm)
    if info is None:
        raise ValueError(f"this {type(gm).__name__} has no data-parallel record (gm.meta[{META_DP!r}]); run "
                         "passes.dp.shard_data_parallel.shard_data_parallel_pass (or passes.compile_rank) on it first")
    return info


def find_dp_info(gm: torch.nn.Module) -> DataParallelInfo | None:
    """The :class:`DataParallelInfo` of a rank graph, or None when the data-parallel pass did not run."""
    meta = getattr(gm, "meta", None)
    return meta.get(META_DP) if isinstance(meta, dict) else None


@dataclass(frozen=True)
class ExpertGroup:
    """Where expert-parallel weights average their gradients (see ``shard_data_parallel_pass``)."""

    axis: str
    """The comm axis of the ranks holding the same experts."""
    size: int
    """dp / ep."""
    index: int
    """This rank's position on that axis (dp_index // ep)."""
    ep: int
    """The expert-parallel degree; gradients are scaled by 1/ep before the average over ``size``."""
