"""The global-batch contract, checked once: every rank must be given the same global batch.

``ParallelModule.train_step(batch)`` (and ``pm(batch)``) take the *global* batch on every rank and
slice out the rank's own share. A training loop written for torch DDP hands each rank a different
shard (a ``DistributedSampler``); that would train silently on the wrong data. On the first batch
a rank sees, each rank reduces its batch to a few float64 numbers per tensor (element count, sum,
and a position-weighted sum, so a permutation differs too), the ranks all-gather them (a few
hundred bytes, once), and a mismatch raises on every rank, naming the ranks that differ from
rank 0 and the tensor. Later batches are not checked (that would cost a collective per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

__all__ = ["BatchMismatchError", "batch_fingerprint", "check_same_batch"]


class BatchMismatchError(RuntimeError):
    """Ranks were given different global batches."""


def batch_fingerprint(batch: Sequence[Any]) -> torch.Tensor:
    """float64 [numel, sum, weighted sum] per tensor of ``batch`` (non-tensors hash to their repr)."""
    parts: list[float] = []
    for leaf in tree_flatten(list(batch))[0]:
        if isinstance(leaf, torch.Tensor):
            x = leaf.detach().reshape(-1).to("cpu", torch.float64)
            w = torch.arange(x.numel(), dtype=torch.float64, device="cpu") % 251 + 1  # lint: cpu -- x is on the host
            parts += [float(x.numel()), float(x.sum()), float((x * w).sum())]
        else:
            parts += [0.0, float(hash(repr(leaf)) % 2**31), 0.0]
    return torch.tensor(parts, dtype=torch.float64, device="cpu")  # lint: cpu -- built from host floats


def check_same_batch(batch: Sequence[Any], *, device: torch.device) -> None:
    """Raise :class:`BatchMismatchError` on every rank unless all ranks hold the same ``batch``. Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = batch_fingerprint(batch).to(device)
    lengths = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, torch.tensor([float(mine.numel())], dtype=torch.float64, device=device))
    longest = int(max(float(t.item()) for t in lengths))
    padded = torch.full((longest,), float("nan"), dtype=torch.float64, device=device)
    padded[: mine.numel()] = mine
    every = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    dist.all_gather(every, padded)
    ref = every[0].cpu()
    differ = [r for r, t in enumerate(every) if not torch.equal(t.cpu().nan_to_num(-1.0), ref.nan_to_num(-1.0))]
    if differ:
        raise BatchMismatchError(
            f"ranks {differ} were given a different global batch than rank 0 on the first step. Every rank must be "
            "given the same global batch: parallelize slices each rank's share itself (do not shard the data "
            "per rank with a DistributedSampler; seed the loader the same on every rank)")
