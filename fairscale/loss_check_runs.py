"""The loss check's runs: the model's loss and gradient on a batch and on its pieces, each run from
the same state, and how far the pieces' gradients, weighed, are from the batch's.

    out = run_batches(model, loss_fn, (whole, *pieces))   # [(loss, gradient summary)], one per batch
    off = gradient_error(out[0][1], [(w, g) for w, (_, g) in zip(weights, out[1:])])

``fairscale.loss_check`` decides from these whether a plan may cut the batch.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fairscale.loss_check_mode import checking_mode
from fairscale.runtime.modes import attributes_kept
from planner.capture import LossModule
from planner.eager_writes import written_tensors

__all__ = ["GRAD_TOL", "batch_rows", "gradient_error", "param_dtype", "run_batches"]

GRAD_TOL = 1e-4
"""How far, relative to its norm, a parameter tensor's gradient may be between the batch and its
pieces in float32 (:func:`gradient_error`). Rounding keeps it under 1e-6 on every corpus model;
a router's load-balancing loss (Hugging Face MoE with output_router_logits=True, coefficient
0.001) moves the routers' gradients by 1e-3 and more, under the losses' own tolerance of 1e-3."""


def gradient_error(whole: torch.Tensor | None, pieces: list[tuple[float, torch.Tensor | None]]) -> float | None:
    """How far the pieces' gradient projections, weighed, are from the whole batch's, relative to
    the larger, and for each parameter tensor relative to its own gradient's norm (the larger of
    the two); None when there is no gradient to compare. A gradient is ``[projections, norms,
    sizes]``, one column per parameter tensor (:func:`_loss`)."""
    if whole is None or any(g is None for _, g in pieces):
        return None
    combined = sum((w * g[0] for w, g in pieces if w and g is not None), torch.zeros_like(whole[0]))
    if not bool(torch.isfinite(combined).all()) or not bool(torch.isfinite(whole).all()):
        return math.inf  # a piece's gradient is nan where the batch's is not (or the other way round)
    scale = max(float(whole[0].norm()), float(combined.norm()))
    if scale == 0:
        return None
    # each tensor against its own norm, floored at its share of the whole gradient's norm by size
    # (fairscale.numerics.compare's scale): a coupling term with a small coefficient (a router's
    # load-balancing loss x 0.001) moves the router's gradient by percents and the whole by less
    # than the tolerance
    norms, sizes = whole[1], whole[2]
    share = torch.sqrt(norms.pow(2).sum() * sizes / sizes.sum())
    each = (whole[0] - combined).abs() / torch.maximum(norms, share).clamp_min(1e-300)
    return max(float((whole[0] - combined).norm()) / scale, float(each.max()))


def run_batches(model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, batches: Sequence[tuple[Any, ...]], *,
                training: bool = False) -> list[tuple[float, torch.Tensor | None]]:
    """:func:`_loss` of each batch on the user's model, each run from the same weights. A forward may
    write parameters in place: an eval-mode forward of HF ``RwkvModel`` divides weights and flips
    ``layers_are_rescaled`` (the next training forward multiplies them back), a momentum teacher
    takes an EMA step of the student's weights at every call. Planning must leave the model as it
    was, and each run must start where the first did (the pieces of a batch compared with the whole
    had seen a teacher one step further each, and a model that is exact under data parallelism was
    refused as coupling its rows). :class:`_ParametersKept` saves each parameter an op is about to
    write, once, and puts it back after the run: only the written ones are copied (a copy of every
    model would double its memory on the planning rank: a 13B model in fp32 on one 80 GB GPU, out
    of memory where it trained). What the forward rebinds on a module (a flag, a cache) and its
    buffers are put back by :func:`_loss`."""
    out = []
    for batch in batches:
        kept = _ParametersKept(model)
        try:
            with kept:
                out.append(_loss(model, loss_fn, batch, training))
        finally:
            kept.restore()
    return out


class _ParametersKept(TorchDispatchMode):
    """Saves the value of each of ``model``'s parameters before the first ATen op that writes its
    storage (``w.div_(2)`` under ``no_grad``, ``w.data.copy_(...)``); :meth:`restore` puts them back."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.params = {p.untyped_storage()._cdata: p for p in model.parameters()}
        self.saved: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        for value in written_tensors(func, args, kwargs):
            key = value.untyped_storage()._cdata
            if key in self.params and key not in self.saved:
                self.saved[key] = self.params[key].detach().clone()
        return func(*args, **kwargs)

    @torch.no_grad()
    def restore(self) -> None:
        for key, value in self.saved.items():
            self.params[key].copy_(value)
        self.saved.clear()


def batch_rows(batch: tuple[Any, ...], lo: int, hi: int) -> tuple[Any, ...]:
    """Rows ``lo:hi`` of every tensor the runtime slices (dim 0 of each tensor with dims)."""
    return tuple(t[lo:hi] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in batch)


def param_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _loss(model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, batch: tuple[Any, ...],
          training: bool = False) -> tuple[float, torch.Tensor | None]:
    """The loss of ``batch`` and its gradient's projection (one random projection per parameter
    tensor, from fixed seeds: the same for every batch), in eval mode or in training mode with
    constant draws (``fairscale.loss_check_mode.checking_mode``), from a fixed random state;
    the modules' attributes (their training flags, what the forward rebinds: a flag, a cache) and
    buffers are restored after, so that each of the check's runs starts from the same state (a
    forward that counts its calls, or keeps an average, would carry one run into the next, and into
    the user's model), and no ``.grad`` is touched."""
    buffers = [(m, name, b, b.detach().clone()) for m in model.modules() for name, b in m._buffers.items()
               if b is not None]
    params = [p for p in model.parameters() if p.requires_grad]
    with attributes_kept(model):
        try:
            with checking_mode(model, training), torch.enable_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                loss = LossModule(model, loss_fn)(*batch)
                value = float(loss.detach().double())
                if not params or not loss.requires_grad:
                    return value, None
                grads = torch.autograd.grad(loss, params, allow_unused=True)
        finally:
            with torch.no_grad():
                for m, name, b, saved in buffers:
                    m._buffers[name] = b  # a forward that rebinds the buffer, or writes it in place
                    b.copy_(saved)
    projection = [float((g.double() * torch.randn(g.shape, generator=torch.Generator().manual_seed(i),
                                                  dtype=torch.float64).to(g.device)).sum())
                  if g is not None else 0.0 for i, g in enumerate(grads)]
    norms = [float(g.double().norm()) if g is not None else 0.0 for g in grads]
    return value, torch.tensor([projection, norms, [float(p.numel()) for p in params]], dtype=torch.float64)
