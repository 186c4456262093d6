"""Batch-statistic ops that the batch-norm pass (``passes.dp.batch_norm``) calls from rank graphs.

A printed rank graph reads ``batch_norm_sync(conv2d, w, b, running_mean, running_var, None, 0.1,
1e-05, 'dp')``. Every rank of the axis group holds a slice of the global batch; the ``_sync`` ops
normalize with the statistics of the whole global batch, so every rank computes what one process
computes on the full batch (SyncBatchNorm semantics), and the ``_local`` ops with the rank's own::

    op                  forward                                    backward
    batch_norm_sync     all-reduce [Σx, n] (C+1), then Σ(x-μ)² (C)  all-reduce [Σg, Σg·x̂] (2C)
    instance_norm_sync  per-sample output; all-reduce the batch    (per sample, no communication)
                        sums of per-sample mean and var (2C+1),
                        for the running statistics only

Batch norm (Ioffe & Szegedy 2015, Algorithm 1), per channel over N = all ranks' samples × spatial
positions: ``μ = Σx/N``, ``σ² = Σ(x-μ)²/N`` (two passes, as one process computes it, so the
variance does not lose digits to cancellation), ``y = (x-μ)/√(σ²+ε)·w + b``. Backward, with each
rank's upstream gradient ``g`` (of its own loss; the data-parallel pass averages parameter
gradients over the ranks afterwards)::

    dx = w/√(σ²+ε) · (g - ΣG/N - x̂·ΣGx̂/N)        ΣG, ΣGx̂: sums over all ranks (the all-reduce)
    dw = Σ_local g·x̂,   db = Σ_local g             (the dp average then sums them over ranks)

which is ``n`` × the gradient of the mean loss, the same scale every other local gradient has
before the data-parallel average (torch's SyncBatchNorm backward does the same all-reduce).

Running statistics are updated in place once per forward exactly as ``nn.BatchNorm*d`` does:
``r ← (1-m)·r + m·s`` with the batch mean and the *unbiased* batch variance ``σ²·N/(N-1)`` of the
global batch (``m = 1/num_batches_tracked`` when the module's momentum is None), so they are
identical on every rank and equal to one process's. When activation recompute runs the forward
again inside backward, the update is skipped (it already happened in the forward).

Every op computes its statistics in float32 (float64 for float64 inputs), as the native kernels do
for half-precision inputs. Nothing here imports ``planner`` or the rewriting passes.
"""

from __future__ import annotations

from typing import Any

import torch

from passes.ops import comm
from passes.ops.groups import group_function

__all__ = ["batch_norm_sync", "batch_norm_local", "instance_norm_sync", "instance_norm_local"]


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _in_backward() -> bool:
    """True while autograd's engine runs a backward pass: a recompute region re-running forward."""
    return torch._C._current_graph_task_id() != -1


def _sum_all(t: torch.Tensor, axis: str | None) -> torch.Tensor:
    if axis is not None:
        comm.all_reduce_(t, axis)
    return t


@group_function  # backward all-reduces over the forward's groups, also in loss.backward() outside pm
class _BatchNorm(torch.autograd.Function):
    """Normalization with the statistics of the axis group's global batch; returns (y, mean, var, N)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                axis: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = _acc_dtype(x)
        xa = x.to(acc)
        dims = [d for d in range(x.dim()) if d != 1]
        count = x.numel() // x.shape[1]
        first = torch.cat([xa.sum(dims), xa.new_tensor([count])])
        _sum_all(first, axis)
        n = first[-1]
        if int(n.item()) <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {list(x.shape)}"
                             + (f" on each rank of axis {axis!r} ({int(n.item())} in all)" if axis else ""))
        mean = first[:-1] / n
        shape = [1, -1] + [1] * (x.dim() - 2)
        centered = xa - mean.view(shape)
        var = _sum_all(centered.square().sum(dims), axis) / n
        invstd = torch.rsqrt(var + eps)
        y = centered * invstd.view(shape)
        if weight is not None:
            y = y * weight.to(acc).view(shape)
        if bias is not None:
            y = y + bias.to(acc).view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.axis, ctx.n, ctx.has_bias = axis, n, bias is not None
        ctx.mark_non_differentiable(mean, var, n)
        return y.to(x.dtype), mean, var, n

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        acc = _acc_dtype(x)
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, -1] + [1] * (x.dim() - 2)
        ga = g.to(acc)
        xhat = (x.to(acc) - mean.view(shape)) * invstd.view(shape)
        sum_g = ga.sum(dims)
        sum_gx = (ga * xhat).sum(dims)
        grad_x = grad_w = grad_b = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_gx.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = sum_g.to(weight.dtype if weight is not None else g.dtype)
        if ctx.needs_input_grad[0]:
            both = _sum_all(torch.cat([sum_g, sum_gx]), ctx.axis) / ctx.n
            c = x.shape[1]
            scale = invstd if weight is None else invstd * weight.to(acc)
            grad_x = ((ga - both[:c].view(shape) - xhat * both[c:].view(shape)) * scale.view(shape)).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None


@torch.no_grad()
def _update(running: torch.Tensor | None, value: torch.Tensor, factor: float) -> None:
    """``running ← (1 - factor)·running + factor·value`` in place (``nn.BatchNorm``'s update).

    Through ``.data``, which does not bump the version counter: the native kernel updates the
    buffers invisibly to autograd too, and activation recompute saved them as region inputs and
    checks that their version is unchanged when it re-runs the region in backward."""
    if running is not None:
        running.data.mul_(1.0 - factor).add_(value.to(running.dtype), alpha=factor)


def _factor(momentum: float | None, num_batches_tracked: torch.Tensor | None) -> float:
    if momentum is not None:
        return momentum
    if num_batches_tracked is None:
        raise ValueError("batch norm with momentum None (a cumulative average) needs num_batches_tracked")
    return 1.0 / float(num_batches_tracked)


def _batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                num_batches_tracked: torch.Tensor | None, momentum: float | None, eps: float,
                axis: str | None) -> torch.Tensor:
    y, mean, var, n = _BatchNorm.apply(x, weight, bias, eps, axis)
    if (running_mean is not None or running_var is not None) and not _in_backward():
        factor = _factor(momentum, num_batches_tracked)
        _update(running_mean, mean, factor)
        _update(running_var, var * (n / (n - 1)), factor)
    return y


def batch_norm_sync(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                    num_batches_tracked: torch.Tensor | None, momentum: float | None, eps: float,
                    axis: str) -> torch.Tensor:
    """Training-mode batch norm of ``x`` (N, C, ...) over the global batch of the ranks of ``axis``;
    running statistics (if given) updated once, identically on every rank."""
    return _batch_norm(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, axis)


def batch_norm_local(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                     num_batches_tracked: torch.Tensor | None, momentum: float | None, eps: float) -> torch.Tensor:
    """Training-mode batch norm over this rank's own batch (``nn.BatchNorm*d`` on it); the running
    statistics are not updated again when recompute re-runs the forward."""
    return _batch_norm(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, None)


def _instance_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   running_mean: torch.Tensor | None, running_var: torch.Tensor | None, momentum: float,
                   eps: float, axis: str | None) -> torch.Tensor:
    y = torch.instance_norm(x, weight, bias, None, None, True, 0.0, eps, False)  # per sample: native autograd
    if (running_mean is None and running_var is None) or _in_backward():
        return y
    with torch.no_grad():
        # torch's instance norm updates each sample's copy of the running statistics with that
        # sample's mean and unbiased variance (over its spatial positions), then averages the
        # copies over the batch: r ← (1-m)·r + m·mean over samples of the per-sample statistic
        dims = list(range(2, x.dim()))
        var, mean = torch.var_mean(x.detach().to(_acc_dtype(x)), dims, correction=1)
        sums = _sum_all(torch.cat([mean.sum(0), var.sum(0), mean.new_tensor([x.shape[0]])]), axis)
        c = x.shape[1]
        _update(running_mean, sums[:c] / sums[-1], momentum)
        _update(running_var, sums[c:2 * c] / sums[-1], momentum)
    return y


def instance_norm_sync(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                       running_mean: torch.Tensor | None, running_var: torch.Tensor | None, momentum: float,
                       eps: float, axis: str) -> torch.Tensor:
    """Instance norm (per sample) whose running statistics average the per-sample statistics over
    the global batch of the ranks of ``axis``."""
    return _instance_norm(x, weight, bias, running_mean, running_var, momentum, eps, axis)


def instance_norm_local(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                        running_mean: torch.Tensor | None, running_var: torch.Tensor | None, momentum: float,
                        eps: float) -> torch.Tensor:
    """Instance norm whose running statistics average over this rank's own batch."""
    return _instance_norm(x, weight, bias, running_mean, running_var, momentum, eps, None)
