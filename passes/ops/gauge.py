"""Byte gauges the run-time ops keep for what they allocate besides parameters and gradients.

The data-parallel ops add and subtract the bytes of FSDP's gathered (unsharded) parameter
buffers, of full-size gradients waiting for their reduce-scatter, and of gradient accumulators
kept under ``no_sync``: what the planner calls a rank's *buffers* (``planner.cost_memory.
unshard_buffer_bytes``). ``fairscale.runtime.memory_report`` reads the peak since its last reset.
Process-wide, like ``comm.COUNTER``: one rank per process.
"""

from __future__ import annotations

import torch

__all__ = ["Gauge", "UNSHARD", "nbytes"]


class Gauge:
    """Bytes held now and the most held since :meth:`reset_peak`."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def sub(self, n: int) -> None:
        self.now -= n

    def reset_peak(self) -> None:
        self.peak = self.now


UNSHARD = Gauge()
"""FSDP gathered parameters, unsharded gradients in flight, and ZeRO-2/FSDP accumulators."""


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
