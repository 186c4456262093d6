"""Explicit backward-order edges between otherwise independent tensors, through phonies.

    a, phony = fork(a)     # a's grad_fn gains an output: phony
    b = join(b, phony)     # b now depends on a: in backward, b's gradient is computed before a's

Forward values are untouched (``detach()``); only the autograd graph changes. Without grad mode,
or when nothing requires grad, both are the identity and create no Function.
"""

from __future__ import annotations

from typing import Any

import torch

from fairscale.nn.pipe.phony import get_phony

__all__ = ["fork", "Fork", "join", "Join"]


def fork(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: A002
    """``(input, phony)``: a phony whose gradient path leads to ``input``'s."""
    if torch.is_grad_enabled() and input.requires_grad:
        return Fork.apply(input)
    return input, get_phony(input.device, requires_grad=False)


class Fork(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: A002
        phony = get_phony(input.device, requires_grad=False)
        return input.detach(), phony.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: torch.Tensor, grad_grad: torch.Tensor) -> torch.Tensor:
        return grad_input


def join(input: torch.Tensor, phony: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """``input`` made to depend on ``phony`` in backward."""
    if torch.is_grad_enabled() and (input.requires_grad or phony.requires_grad):
        return Join.apply(input, phony)
    return input


class Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, phony: torch.Tensor) -> torch.Tensor:  # noqa: A002
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_input, None
