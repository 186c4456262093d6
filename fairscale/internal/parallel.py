"""Process-group helpers for sharded training."""

from __future__ import annotations

import sys
from enum import Enum
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["chunk_and_pad", "validate_process_group", "enable_pytorch_sync_bn", "ProcessGroupName",
           "get_process_group_cached"]


def chunk_and_pad(tensor: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
    """``tensor`` flattened into exactly ``num_chunks`` equal pieces, the tail padded with zeros.

    ``torch.chunk`` gives pieces of ``ceil(n / num_chunks)`` and may give fewer than asked (10
    elements in 4 chunks: 3, 3, 3, 1; 5 elements in 4: 2, 2, 1): the last piece is padded and missing
    pieces are zeros, so every rank of a ``num_chunks`` group gets a shard of the same size.
    """
    chunks = list(torch.flatten(tensor).chunk(num_chunks))
    short = chunks[0].numel() - chunks[-1].numel()
    if short > 0:
        chunks[-1] = F.pad(chunks[-1], [0, short])
    chunks += [torch.zeros_like(chunks[0]) for _ in range(num_chunks - len(chunks))]
    return chunks


def validate_process_group(device: torch.device, process_group: Any) -> None:
    """Check that every rank of ``process_group`` answers on ``device`` (CUDA only: catches a missing
    ``torch.cuda.set_device``, which makes two ranks share a GPU). Test doubles without
    ``allgather`` are accepted as they are."""
    if not hasattr(process_group, "allgather") or "cuda" not in str(device):
        return
    world_size = process_group.size()
    out = list(torch.zeros(world_size, device=device).chunk(world_size))
    dist.all_gather(out, torch.ones(1, device=device), group=process_group)
    found = torch.cat(out).sum().item()
    if found != world_size:
        raise AssertionError(f"found {found} devices in the process group but world_size={world_size}; "
                             "call torch.cuda.set_device(local_rank) on each rank before wrapping the model")


def enable_pytorch_sync_bn(module: torch.nn.Module) -> None:
    """Let ``torch.nn.SyncBatchNorm`` layers run outside DDP on torch versions that need
    ``_specify_ddp_gpu_num`` (removed in torch 1.9; a no-op there)."""
    for layer in module.modules():
        if isinstance(layer, torch.nn.SyncBatchNorm) and hasattr(layer, "_specify_ddp_gpu_num"):
            layer._specify_ddp_gpu_num(1)


class ProcessGroupName(str, Enum):
    """The cached groups FSDP uses: the default one and a second one for overlapped reduce-scatter."""

    default = "default"
    reduce_scatter = "reduce_scatter"


_GROUPS: dict[Any, Any] = {}


def get_process_group_cached(name: ProcessGroupName = ProcessGroupName.default,
                             ranks: Sequence[int] | None = None) -> Any:
    """One process group per ``(name, ranks)``, created on first request and reused after.

    Like ``dist.new_group``, every rank must make the same calls in the same order, members or not.
    The first call also creates the default group over all ranks, so that FSDP instances built
    with default arguments share one group (and one reduce-scatter bucket). Without
    ``torch.distributed`` initialized it raises, except for the ``reduce_scatter`` group under pytest,
    where test doubles stand in for groups (None is returned).
    """
    if not dist.is_initialized():
        if name == ProcessGroupName.reduce_scatter and "pytest" in sys.modules:
            return None
        raise RuntimeError("torch.distributed is not initialized, but a process group was requested; "
                           "call torch.distributed.init_process_group first")
    if _GROUPS.get("world") is not dist.group.WORLD:  # a new init_process_group: old groups are dead
        _GROUPS.clear()
        _GROUPS["world"] = dist.group.WORLD
        default = dist.new_group()
        _GROUPS[None] = default
        _GROUPS[(ProcessGroupName.default, None)] = default
        _GROUPS[(ProcessGroupName.default, tuple(range(dist.get_world_size())))] = default
    key = (name, None if ranks is None else tuple(sorted(set(ranks))))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(ranks=None if ranks is None else list(key[1]))  # type: ignore[index]
    return _GROUPS[key]
