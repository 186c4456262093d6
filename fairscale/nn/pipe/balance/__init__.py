"""Automatic ``balance`` for :class:`fairscale.nn.Pipe`: by measured time or by memory size.

    from fairscale.nn.pipe.balance import balance_by_time
    balance = balance_by_time(4, model, torch.randn(32, 3, 224, 224))
    pipe = Pipe(model, balance, chunks=8)

Both split the layers into contiguous partitions minimizing the largest partition cost (exact
dynamic program, see ``blockpartition``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fairscale.nn.pipe.balance import blockpartition
from fairscale.nn.pipe.balance.profile import profile_sizes, profile_times

__all__ = ["balance_by_time", "balance_by_size", "balance_cost"]

balance_cost = blockpartition.balance_cost


def _device_of(sample: Any, device: Any) -> torch.device:
    if device is not None:
        return torch.device(device)
    first = sample[0] if isinstance(sample, tuple) else sample
    return first.device


def balance_by_time(partitions: int, module: nn.Sequential, sample: Any, *, timeout: float = 1.0,
                    device: Any = None) -> list[int]:
    """Balance by forward + backward wall time of each layer on ``sample`` (one micro-batch).

    Args:
        partitions: number of partitions.
        module: the ``nn.Sequential`` to split.
        sample: an input micro-batch (a tensor or a tuple of tensors).
        timeout: profile for at least this many seconds (repeating passes) for stable timings.
        device: where to profile (default: the sample's device).
    """
    times = profile_times(module, sample, timeout=timeout, device=_device_of(sample, device))
    return blockpartition.balance_cost(times, partitions)


def balance_by_size(partitions: int, module: nn.Sequential, input: Any, *, chunks: int = 1,
                    param_scale: float = 2.0, device: Any = None) -> list[int]:
    """Balance by memory: saved activations of one of ``chunks`` micro-batches of ``input`` plus
    parameter bytes × ``param_scale`` (2: weights and gradients; about 4 for Adam).

    Args:
        partitions: number of partitions.
        module: the ``nn.Sequential`` to split.
        input: a whole mini-batch (a tensor or a tuple of tensors).
        chunks: the ``chunks`` you will give to Pipe.
        param_scale: bytes per parameter byte held during training.
        device: where to profile (default: the input's device).
    """
    sizes = profile_sizes(module, input, chunks=chunks, param_scale=param_scale, device=_device_of(input, device))
    return blockpartition.balance_cost(sizes, partitions)
