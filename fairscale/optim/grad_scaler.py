"""AMP gradient scalers: ``GradScaler`` and ``ShardedGradScaler`` (FairScale 0.4.13 paths).

With sharded gradients (OSS, ShardedDataParallel, FSDP) each rank only sees the gradients of its
own shard, so one rank may find an inf/NaN that the others do not. ``ShardedGradScaler`` combines
the per-rank verdicts with a MAX all-reduce before the step, so every rank skips (or takes) the
same step and the loss scale stays identical everywhere::

    scaler = ShardedGradScaler()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)          # OSS, or any optimizer
    scaler.update()

Both work on CPU-only machines: the device defaults to CUDA only when it is available.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fairscale.optim.oss import axis_for_group
from passes.ops import comm

__all__ = ["GradScaler", "ShardedGradScaler"]


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose device defaults to CPU when no GPU is present."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, *, device: str | None = None) -> None:
        super().__init__(device or _default_device(), init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)


class ShardedGradScaler(GradScaler):
    """A :class:`GradScaler` whose inf/NaN check is agreed on by every rank of ``process_group``.

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as ``torch.amp.GradScaler``.
        process_group: ranks that must agree (default: the world, when torch.distributed is initialized;
            otherwise this behaves like a plain scaler).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, process_group: Any = None, *,
                 device: str | None = None) -> None:
        super().__init__(init_scale, growth_factor, backoff_factor, growth_interval, enabled, device=device)
        self.process_group = process_group
        self.axis: str | None = None
        if dist.is_initialized():
            self.axis = axis_for_group(process_group, prefix="scaler")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled:
            return
        super().unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        per_device: dict[torch.device, torch.Tensor] = state["found_inf_per_device"]
        if self.axis is None or comm.group_size(self.axis) == 1:
            if not per_device:  # a rank whose optimizer holds no gradient: nothing overflowed
                assert self._scale is not None
                per_device[self._scale.device] = torch.zeros((), dtype=torch.float32, device=self._scale.device)
            return
        # One flag per rank (ranks may own gradients on different devices, or none at all).
        assert self._scale is not None
        flag = torch.zeros(1, dtype=torch.float32, device=self._scale.device)
        for v in per_device.values():
            flag += v.to(flag.device).reshape(1)
        comm.all_reduce_(flag, self.axis, op=dist.ReduceOp.MAX)
        agreed = flag[0]
        if not per_device:
            per_device[self._scale.device] = agreed.clone()
        for dev in list(per_device):
            per_device[dev] = agreed.to(dev).clone()
