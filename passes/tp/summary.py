"""The record the tensor-parallel pass leaves on a rank graph (``gm.meta["fs_tp_summary"]``): its
degree, index and axis, whether it is sequence parallel, what it sharded, its collective counts, and
the rank-local (placement, shape) of every value the stage receives and sends, which sizes the
pipeline's point-to-point buffers (``fairscale.runtime.pipeline_io.local_specs``). A leaf: the
runtime imports it, not the pass."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["META_TP_SUMMARY", "tp_summary"]

META_TP_SUMMARY = "fs_tp_summary"
"""gm.meta key: ``{"tp_size", "tp_index", "axis", "sequence_parallel", "sharded", "collectives",
"received", "sent"}`` (``received``/``sent``: ``[(placement or "-", local shape)]`` per boundary value)."""


def tp_summary(gm: torch.nn.Module) -> dict[str, Any] | None:
    """The summary :func:`passes.tp.shard_tensor_parallel.shard_tensor_parallel_pass` left on ``gm``;
    None for a graph it did not rewrite."""
    meta = getattr(gm, "meta", None)
    return meta.get(META_TP_SUMMARY) if isinstance(meta, dict) else None
