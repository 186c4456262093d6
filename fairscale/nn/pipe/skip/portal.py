"""Portals: how a skip tensor travels from the partition that stashes it to the one that pops it
without passing through the partitions in between.

The tensor sits in a :class:`Portal`; three autograd functions connect it to the micro-batch's
graph through phonies, so that its gradient flows back to where it was stashed::

    PortalBlue    (stash side)  takes the tensor into the graph; in backward hands out the gradient
                                that PortalOrange left in the portal
    PortalCopy    (between)     moves the tensor to the popping partition's device (and the
                                gradient back)
    PortalOrange  (pop side)    returns the tensor; in backward leaves its gradient in the portal

``tensor_life`` counts how many more times the tensor will be taken out (blue, orange, and their
repeats when the partitions are checkpointed); at 0 the portal drops its reference, so the tensor
is freed as soon as nothing needs it any more.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from fairscale.nn.pipe.copy import Copy
from fairscale.nn.pipe.phony import get_phony
from fairscale.nn.pipe.stream import AbstractStream, get_device

__all__ = ["Portal", "PortalBlue", "PortalOrange", "PortalCopy"]


class Portal:
    """Holds one skip tensor of micro-batch ``index`` for ``tensor_life`` uses."""

    def __init__(self, tensor: Optional[torch.Tensor], tensor_life: int, index: int = 0) -> None:
        self.put_tensor(tensor, tensor_life)
        self.grad: Optional[torch.Tensor] = None
        self.index = index

    def blue(self) -> torch.Tensor:
        """A phony carrying the tensor into the graph (its gradient comes back through the portal)."""
        if self.tensor is None:
            return get_phony(torch.device("cpu"), requires_grad=False)
        return PortalBlue.apply(self, self.use_tensor())

    def orange(self, phony: torch.Tensor) -> Optional[torch.Tensor]:
        """The tensor, after ``phony`` in the graph (its gradient goes into the portal)."""
        self.check_tensor_life()
        if self.tensor is None:
            return self.use_tensor()
        return PortalOrange.apply(self, phony)

    def copy(self, prev_stream: AbstractStream, next_stream: AbstractStream, phony: torch.Tensor) -> torch.Tensor:
        """Move the tensor to ``next_stream``'s device; a phony on that device orders it in the graph."""
        if self.tensor is None:
            return get_phony(torch.device("cpu"), requires_grad=False)
        return PortalCopy.apply(self, prev_stream, next_stream, phony)

    def check_tensor_life(self) -> None:
        if self.tensor_life <= 0:
            raise RuntimeError("the tensor in this portal has been removed (its tensor life is over)")

    def put_tensor(self, tensor: Optional[torch.Tensor], tensor_life: int) -> None:
        """Store ``tensor`` for ``tensor_life`` uses (none: it is not stored)."""
        self.tensor_life = tensor_life
        self.tensor = tensor if tensor_life > 0 else None

    def use_tensor(self) -> Optional[torch.Tensor]:
        """Take the tensor out once; the last use drops the portal's reference."""
        self.check_tensor_life()
        tensor = self.tensor
        self.tensor_life -= 1
        if self.tensor_life <= 0:
            self.tensor = None
        return tensor

    def put_grad(self, grad: torch.Tensor) -> None:
        self.grad = grad

    def use_grad(self) -> torch.Tensor:
        """Take the gradient out (once)."""
        if self.grad is None:
            raise RuntimeError("the gradient in this portal was already used, or never put")
        grad, self.grad = self.grad, None
        return grad


class PortalBlue(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, portal: Portal, tensor: torch.Tensor) -> torch.Tensor:
        ctx.portal = portal
        return get_phony(tensor.device, requires_grad=False).detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, ctx.portal.use_grad()


class PortalOrange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, portal: Portal, phony: torch.Tensor) -> torch.Tensor:
        ctx.portal = portal
        tensor = portal.use_tensor()
        assert tensor is not None
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        ctx.portal.put_grad(grad)
        return None, None


class PortalCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, portal: Portal, prev_stream: AbstractStream, next_stream: AbstractStream,
                phony: torch.Tensor) -> torch.Tensor:
        ctx.portal = portal
        assert portal.tensor is not None
        (portal.tensor,) = Copy.forward(ctx, prev_stream, next_stream, portal.tensor)
        return get_phony(get_device(next_stream), requires_grad=False).detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: torch.Tensor) -> tuple[None, None, None, None]:
        portal = ctx.portal
        assert portal.grad is not None
        _, _, portal.grad = Copy.backward(ctx, portal.grad)
        return None, None, None, None
