"""Buckets: one flat buffer backing several tensors, so one collective moves all of them.

    bucket = ParamBucket(size=2**20, dtype=torch.float32, device=device)
    for p in small_params:
        bucket.add_param(p)            # p.data becomes a view into bucket.buffer (value kept)
    dist.broadcast(bucket.buffer, src=owner)   # every parameter in one call

:class:`ParamBucket` backs parameters (``OSS`` broadcasts its buckets of small parameters after
each step); :class:`GradBucket` backs gradients (``param.grad`` becomes a view), with check-in
counting for a reduction that starts once every gradient arrived, and ``collapse``/``rebuild``
to free the buffer between uses. Sizes are in elements.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["Bucket", "ParamBucket", "GradBucket"]


class Bucket:
    """A flat buffer of ``size`` elements and the tensors registered into it."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self._params: list[torch.Tensor] = []
        self._param_ids: list[int] = []
        self._fill = 0
        self.buffer: torch.Tensor = torch.zeros(size, dtype=dtype, device=device)

    def to(self, device: Any, dtype: torch.dtype | None = None, non_blocking: bool = False,
           keep_param_alignment: bool = True) -> None:
        """Move or cast the buffer (subclasses re-point their tensors into the new one)."""
        self.buffer = self.buffer.to(device, dtype, non_blocking)

    def _view(self, numel: int, shape: torch.Size) -> torch.Tensor:
        end = self._fill + numel
        if end > self.buffer.numel():
            raise AssertionError(f"the bucket is full: {self._fill} + {numel} elements > {self.buffer.numel()}")
        view = self.buffer[self._fill:end].view(shape)
        self._fill = end
        return view


class ParamBucket(Bucket):
    """Parameters whose ``.data`` are views of one buffer."""

    def to(self, device: Any, dtype: torch.dtype | None = None, non_blocking: bool = False,
           keep_param_alignment: bool = True) -> None:
        super().to(device, dtype, non_blocking)
        if keep_param_alignment:
            self._reattach_params()

    @torch.no_grad()
    def add_param(self, param: torch.Tensor) -> None:
        """Back ``param`` by the next slice of the buffer (its value is copied in)."""
        if id(param) in self._param_ids:
            raise AssertionError("the same parameter cannot be added to a bucket twice")
        self._add_param_as_view(param)
        self._params.append(param)
        self._param_ids.append(id(param))

    @torch.no_grad()
    def _add_param_as_view(self, param: torch.Tensor, keep_existing_value: bool = True) -> None:
        if param.dtype != self.buffer.dtype or param.device != self.buffer.device:
            raise AssertionError(f"a {param.dtype} parameter on {param.device} cannot join a {self.buffer.dtype} "
                                 f"bucket on {self.buffer.device}")
        view = self._view(param.numel(), param.shape)
        if keep_existing_value:
            view.copy_(param.data)
        param.data = view

    @torch.no_grad()
    def _reattach_params(self) -> None:
        """Re-point every parameter into the (moved or cast) buffer, in registration order."""
        self._fill = 0
        for p in self._params:
            if p.dtype != self.buffer.dtype:
                p.data = p.data.to(self.buffer.dtype)
            self._add_param_as_view(p, keep_existing_value=False)


class GradBucket(Bucket):
    """Gradients (``param.grad``) that are views of one buffer, reduced to rank ``destination``.

    ``params_checked_in`` counts the gradients that arrived since :meth:`reset_checked_in`;
    :attr:`all_checked_in` says when the bucket can be sent.
    """

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, destination: int) -> None:
        super().__init__(size, dtype, device)
        self._max_size = size
        self._is_collapsed = False
        self.params_checked_in = 0
        self.destination = destination
        self.sent = True
        self.callback: Callable[[Any], None] | None = None

    def reset_checked_in(self) -> None:
        self.params_checked_in = 0
        self.sent = False

    @property
    def all_checked_in(self) -> bool:
        return len(self._params) == self.params_checked_in

    def can_add_grad_view(self, param: torch.Tensor) -> bool:
        """Room left for ``param``'s gradient (strictly: the bucket never fills exactly), and not in yet."""
        return self._fill + param.numel() < self._max_size and id(param) not in self._param_ids

    def to(self, device: Any, dtype: torch.dtype | None = None, non_blocking: bool = False,
           keep_param_alignment: bool = True) -> None:
        if self._is_collapsed:
            self.rebuild()
        super().to(device, dtype, non_blocking)
        if keep_param_alignment:
            self._reattach_grads()

    def zero(self) -> None:
        self.buffer.fill_(0.0)

    @torch.no_grad()
    def add_grad(self, param: torch.Tensor) -> None:
        """Make ``param.grad`` (zeros if it has none) the next slice of the buffer, value kept."""
        if id(param) in self._param_ids:
            raise AssertionError("the same gradient cannot be added to a bucket twice")
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        self._add_grad_as_view(param)
        self._params.append(param)
        self._param_ids.append(id(param))

    @torch.no_grad()
    def collapse(self) -> None:
        """Free the buffer: the gradients become None until :meth:`rebuild`."""
        if self._is_collapsed:
            return
        for p in self._params:
            p.grad = None
        self.buffer = torch.zeros(0, dtype=self.buffer.dtype, device=self.buffer.device)
        self._fill = 0
        self.params_checked_in = 0
        self._is_collapsed = True

    @torch.no_grad()
    def rebuild(self) -> None:
        """Allocate the buffer again after :meth:`collapse`; the gradients are zeros in it."""
        if not self._params:
            raise AssertionError("rebuild() of a bucket without gradients")
        if not self._is_collapsed:
            return
        self.buffer = torch.zeros(self._max_size, dtype=self._params[0].dtype, device=self._params[0].device)
        for p in self._params:
            self._add_grad_as_view(p)
        self._is_collapsed = False

    @torch.no_grad()
    def shrink(self) -> None:
        """Cut the buffer to the gradients it holds (freeing the rest); they keep their values."""
        if self.buffer.numel() == 0:
            raise AssertionError("cannot shrink a collapsed bucket; rebuild() it first")
        self.buffer = self.buffer[:self._fill].clone()
        self._fill = 0
        for p in self._params:
            self._add_grad_as_view(p)
        self._max_size = self._fill

    @torch.no_grad()
    def _reattach_grads(self) -> None:
        self._fill = 0
        for p in self._params:
            self._add_grad_as_view(p, keep_existing_value=False)

    @torch.no_grad()
    def _add_grad_as_view(self, param: torch.Tensor, keep_existing_value: bool = True) -> None:
        if self.buffer.numel() == 0:
            raise AssertionError("cannot add a gradient to a collapsed bucket; rebuild() it first")
        if param.dtype != self.buffer.dtype or param.device != self.buffer.device:
            raise AssertionError(f"a {param.dtype} gradient on {param.device} cannot join a {self.buffer.dtype} "
                                 f"bucket on {self.buffer.device}")
        view = self._view(param.numel(), param.shape)
        if param.grad is not None:
            if keep_existing_value:
                view.copy_(param.grad.data)
            param.grad.data = view
        else:
            param.grad = view
