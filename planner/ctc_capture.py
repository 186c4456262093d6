"""CTC losses a trace can hold: ``F.ctc_loss`` as one op with a known output shape.

torch's ``ctc_loss`` calls ``aten._ctc_loss``, whose second output (the alphas, ``[B, T, 2S+1]``)
has a size that may depend on the target lengths' values, so torch tags the op
``dynamic_output_shape`` and neither FakeTensor nor ``torch.export`` can run it: every model
trained with CTC (ESPnet's and WeNet's conformers, wav2vec 2.0 fine-tuning, ``nn.CTCLoss``) failed
to capture. The loss itself is one value per row, whatever the lengths are.

While a model is traced, :func:`traceable_ctc_loss` makes ``torch.nn.functional.ctc_loss`` (which
``nn.CTCLoss`` calls) compute each row's loss with ``fairscale::ctc_loss_rows`` (torch's own kernel,
``reduction="none"``, zero_infinity applied; its backward is torch's, run on the saved inputs) and
then reduce as ATen's ``ctc_loss`` does, in traced ops::

    "mean": (rows / target_lengths.clamp_min(1)).mean()      "sum": rows.sum()      "none": rows

so the graph shows the per-row normalisation and the mean over rows that data parallelism and
microbatches have to respect, and one process and the ranks compute the same numbers with the same
kernels. Importing this module registers the op (the ranks run it in their graphs).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F

__all__ = ["traceable_ctc_loss", "ctc_loss_rows"]


@torch.library.custom_op("fairscale::ctc_loss_rows", mutates_args=())
def ctc_loss_rows(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
                  target_lengths: torch.Tensor, blank: int, zero_infinity: bool) -> torch.Tensor:
    """Each row's CTC loss: ``torch.ctc_loss(..., reduction="none")``."""
    return torch.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, 0, zero_infinity)


@ctc_loss_rows.register_fake
def _(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor, target_lengths: torch.Tensor,
      blank: int, zero_infinity: bool) -> torch.Tensor:
    return log_probs.new_empty(log_probs.shape[1:2] if log_probs.dim() == 3 else ())


@torch.library.custom_op("fairscale::ctc_loss_rows_backward", mutates_args=())
def ctc_loss_rows_backward(grad: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor,
                           input_lengths: torch.Tensor, target_lengths: torch.Tensor, blank: int,
                           zero_infinity: bool) -> torch.Tensor:
    """The gradient of :func:`ctc_loss_rows` for ``log_probs``: what torch's autograd computes for
    ``torch.ctc_loss(..., reduction="none")``, from the alphas recomputed (a backend kernel runs
    below autograd, so it calls the ATen ops itself)."""
    nll, log_alpha = torch.ops.aten._ctc_loss.Tensor(log_probs, targets.to(log_probs.device, torch.long),
                                                     input_lengths, target_lengths, blank, zero_infinity)
    if zero_infinity:  # ATen's ctc_loss zeroes infinite rows with a where, whose backward masks them
        grad = torch.where(nll == float("inf"), torch.zeros((), dtype=grad.dtype, device=grad.device), grad)
    return torch.ops.aten._ctc_loss_backward.Tensor(grad, log_probs, targets.to(log_probs.device, torch.long),
                                                    input_lengths, target_lengths, nll, log_alpha, blank,
                                                    zero_infinity)


@ctc_loss_rows_backward.register_fake
def _(grad: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
      target_lengths: torch.Tensor, blank: int, zero_infinity: bool) -> torch.Tensor:
    return torch.empty_like(log_probs)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    log_probs, targets, input_lengths, target_lengths, blank, zero_infinity = inputs
    ctx.save_for_backward(log_probs, targets, input_lengths, target_lengths)
    ctx.blank, ctx.zero_infinity = blank, zero_infinity


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    log_probs, targets, input_lengths, target_lengths = ctx.saved_tensors
    return (ctc_loss_rows_backward(grad, log_probs, targets, input_lengths, target_lengths, ctx.blank,
                                   ctx.zero_infinity), None, None, None, None, None)


ctc_loss_rows.register_autograd(_backward, setup_context=_setup)


def _lengths(lengths: Any, like: torch.Tensor) -> torch.Tensor:
    if isinstance(lengths, torch.Tensor):
        return lengths
    return torch.tensor(list(lengths), dtype=torch.long, device=like.device)


@contextlib.contextmanager
def traceable_ctc_loss() -> Iterator[None]:
    """While tracing: ``F.ctc_loss`` through :func:`ctc_loss_rows` (module docstring); restored after."""
    original = F.ctc_loss

    def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: Any, target_lengths: Any,
                 blank: int = 0, reduction: str = "mean", zero_infinity: bool = False) -> torch.Tensor:
        if reduction not in ("none", "mean", "sum") or log_probs.dim() != 3:
            return original(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)
        inputs, lengths = _lengths(input_lengths, log_probs), _lengths(target_lengths, log_probs)
        rows = torch.ops.fairscale.ctc_loss_rows(log_probs, targets, inputs, lengths, blank, zero_infinity)
        if reduction == "mean":
            return (rows / lengths.to(rows.dtype).clamp_min(1)).mean()
        if reduction == "sum":
            return rows.sum()
        return rows

    F.ctc_loss = ctc_loss
    try:
        yield
    finally:
        F.ctc_loss = original
