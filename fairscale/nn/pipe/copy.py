"""Autograd functions that move micro-batches between devices on copy streams.

``Copy`` copies tensors from ``prev_stream``'s device to ``next_stream``'s (and gradients back);
``Wait`` makes one stream wait for the other in forward and the reverse in backward, without
copying. On the CPU both reduce to a copy (``.to`` is a no-op there) and a detach.
"""

from __future__ import annotations

from typing import Any

import torch

from fairscale.nn.pipe.stream import (AbstractStream, current_stream, get_device, record_stream, use_stream,
                                      wait_stream)

__all__ = ["Copy", "Wait"]


class Copy(torch.autograd.Function):
    """Copies tensors on ``next_stream`` (gradients back on ``prev_stream``)."""

    @staticmethod
    def forward(ctx: Any, prev_stream: AbstractStream, next_stream: AbstractStream,
                *input: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: A002
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        device = get_device(next_stream)
        out_stream = current_stream(device)
        outputs = []
        with use_stream(prev_stream), use_stream(next_stream):
            for x in input:
                y = x.to(device, non_blocking=True)
                outputs.append(y)
                # both stay alive until the copy on next_stream is done
                record_stream(x, prev_stream)
                record_stream(y, out_stream)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple[Any, ...]:
        prev_stream, next_stream = ctx.prev_stream, ctx.next_stream
        device = get_device(prev_stream)
        in_stream = current_stream(device)
        grads = []
        with use_stream(prev_stream), use_stream(next_stream):
            for g in grad_output:
                back = g.to(device, non_blocking=True)
                grads.append(back)
                record_stream(g, next_stream)
                record_stream(back, in_stream)
        return (None, None) + tuple(grads)


class Wait(torch.autograd.Function):
    """``next_stream`` waits for ``prev_stream`` in forward; the reverse in backward."""

    @staticmethod
    def forward(ctx: Any, prev_stream: AbstractStream, next_stream: AbstractStream,
                *input: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: A002
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        wait_stream(next_stream, prev_stream)
        return tuple(x.detach() for x in input)

    @staticmethod
    def backward(ctx: Any, *grad_input: torch.Tensor) -> tuple[Any, ...]:
        wait_stream(ctx.prev_stream, ctx.next_stream)
        return (None, None) + grad_input
