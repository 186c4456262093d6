"""AdaScale: adaptive learning-rate gain for large-batch SGD (FairScale 0.4.13's ``fairscale.optim.AdaScale``).

Johnson, Agrawal, Gu, Guestrin 2020, "AdaScale SGD: A User-Friendly Algorithm for Distributed
Training" (ICML). Each step averages ``cN = world_size × num_gradients_to_accumulate`` gradients
``g_i`` of base-size batches; with ``S = scale`` (default ``cN``) and ``ḡ`` their mean, the gain is
(eq. 3) ``r = (σ² + μ²) / (σ²/S + μ²)``, from the unbiased one-step estimates (section 3.3)::

    σ² = S/(cN−1) · ( (1/cN) Σ_i ‖g_i‖²  −  ‖ḡ‖² )        μ² = ‖ḡ‖² − σ²/S

clamped (σ² ≥ 1e-6, μ² ≥ 0), per param group, and smoothed by a bias-corrected exponential moving
average with factor ``smoothing`` (default ``max(1 − cN/1000, 0)``)::

    optim = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1))   # under DistributedDataParallel
    for batch in loader:
        model(batch).sum().backward()        # the estimates are updated at the end of backward
        step += optim.gain()                 # so gain() already describes this step
        optim.step()                         # lr × gain(group) for this step only
        optim.zero_grad()

Gradient accumulation: with ``num_gradients_to_accumulate = k``, run ``k`` backward passes per
``step()``. By default (``is_scaled_loss=True``) each pass's loss is divided by ``k``, so ``.grad``
ends up holding the mean gradient, as without accumulation; with ``is_scaled_loss=False`` the loss
is not divided, ``.grad`` holds the sum, and ``scale_grad_by_num_grads_to_accum()`` must be called
before ``step()`` to turn it into the mean. ``step()`` itself never changes gradients. Per-pass
gradient norms are read by a hook on each parameter, before any data-parallel reduction; the
estimates are updated once the ``k``-th backward pass ends (after DDP's reduction).

The estimates live in the wrapped optimizer's state (``optimizer.state["adascale"]``), so they are
saved and restored with ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd import Variable

from fairscale.optim.oss import axis_for_group
from passes.ops import comm

__all__ = ["AdaScale", "AdaScaleWrapper"]


class AdaScale(torch.optim.Optimizer):
    """Wrap ``optimizer`` to scale its learning rate by the AdaScale gain each step.

    Args:
        optimizer: the wrapped optimizer (SGD in the paper; an ``OSS`` optimizer works too).
        world_size: data-parallel ranks whose gradients are averaged (default: the torch.distributed
            world size, or 1).
        scale: ``S``, the batch-size multiple over the base batch (default
            ``world_size × num_gradients_to_accumulate``).
        smoothing: moving-average factor of the estimates (default ``max(1 − cN/1000, 0)``).
        num_gradients_to_accumulate: backward passes per ``step()``.
        is_scaled_loss: each accumulated pass's loss is divided by ``num_gradients_to_accumulate``
            (see the module docstring).
        debias_ewma: bias-corrected moving average (``False``: plain average over the first
            ``1/(1 − smoothing)`` steps, then the moving average, as in the paper's appendix B.3).

    One gradient per step (``world_size × num_gradients_to_accumulate == 1``) has no variance to
    estimate: that raises ``RuntimeError``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, world_size: int | None = None, scale: float | None = None,
                 smoothing: float | None = None, num_gradients_to_accumulate: int = 1, is_scaled_loss: bool = True,
                 debias_ewma: bool = True) -> None:
        self._hook_handles: list[Any] = []
        self._optimizer = optimizer
        self._local_grad_sqr: torch.Tensor | None = None  # not None while a step's backward passes run
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._world_size = int(world_size)
        self._num_backward_calls = 0
        self._last_final_backward_call = 0
        self._final_callback_queued = False
        self._debias_ewma = debias_ewma
        self._is_scaled_loss = is_scaled_loss
        self._axis: str | None = None
        if self._world_size > 1:
            if not dist.is_initialized() or dist.get_world_size() != self._world_size:
                raise ValueError(f"AdaScale(world_size={world_size}) needs torch.distributed initialized with that "
                                 "many ranks: it sums the per-rank gradient norms over the world")
            self._axis = axis_for_group(None, prefix="adascale")
        self.param_groups = optimizer.param_groups
        self.set_num_gradients_to_accumulate(num_gradients_to_accumulate, update_smoothing=True)
        if smoothing is not None:
            self._smoothing = float(smoothing)
        if self._world_size * self._num_grads_to_accum <= 1:
            raise RuntimeError("AdaScale needs at least two gradients per step (world_size × "
                               "num_gradients_to_accumulate > 1): with one there is no gradient variance to estimate")
        n = len(optimizer.param_groups)
        optimizer.state.setdefault("adascale", {"grad_sqr_avg": np.ones(n), "grad_var_avg": np.zeros(n)})
        self._scale = 1.0
        self.set_scale(self._world_size * self._num_grads_to_accum if scale is None else scale)  # an int stays one
        self._hook()

    # ---------------------------------------------------------------------------------- hooks

    def _hook(self) -> None:
        assert not self._hook_handles, "unhook() first"
        for idx, group in enumerate(self._optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    self._hook_handles.append(p.register_hook(functools.partial(self._backward_hook, idx)))

    def unhook(self) -> None:
        """Remove the gradient hooks (so the parameters, and their memory, can be freed without this
        optimizer; it stops estimating until hooked again by ``add_param_group``)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []

    def __del__(self) -> None:
        self.unhook()

    def _backward_hook(self, pg_idx: int, grad: torch.Tensor) -> None:
        # one pass's local gradient, before any data-parallel reduction
        # in the gradients' dtype (float32), as 0.4.13 sums them: its gains to the last bit
        if self._local_grad_sqr is None:
            self._local_grad_sqr = torch.zeros(len(self._optimizer.param_groups), device=grad.device)
        self._local_grad_sqr[pg_idx] += grad.detach().pow(2).sum()
        self._final_callback_queued = False
        Variable._execution_engine.queue_callback(self._queue_final_callback)

    def _queue_final_callback(self) -> None:
        # runs among the end-of-backward callbacks; queueing again puts the estimate after all of
        # them, DDP's gradient averaging included
        if not self._final_callback_queued:
            self._final_callback_queued = True
            Variable._execution_engine.queue_callback(self._final_callback)

    def _final_callback(self) -> None:
        self._final_callback_queued = False
        self._num_backward_calls += 1
        passes = self._num_backward_calls - self._last_final_backward_call
        assert passes <= self._num_grads_to_accum, (
            f"{passes} backward passes since the last step, but num_gradients_to_accumulate is "
            f"{self._num_grads_to_accum}")
        if passes % self._num_grads_to_accum == 0:
            self._update_estimates()

    # ---------------------------------------------------------------------------------- estimates

    @property
    def _state(self) -> dict[str, np.ndarray]:
        return self._optimizer.state["adascale"]

    def _update_estimates(self) -> None:
        """Fold this step's ``Σ‖g_i‖²`` and ``‖ḡ‖²`` into the smoothed σ², μ² (module docstring)."""
        local = self._local_grad_sqr
        assert local is not None
        work = comm.all_reduce_(local, self._axis, async_op=True) if self._axis is not None else None
        total = np.array([sum(p.grad.detach().pow(2).sum().item() for p in group["params"] if p.grad is not None)
                          for group in self._optimizer.param_groups], dtype=np.float64)
        if work is not None:
            work.wait()
        local_sqr = local.cpu().numpy()
        k = self._num_grads_to_accum
        if k > 1:
            if self._is_scaled_loss:
                local_sqr = local_sqr * k ** 2  # each pass saw g_i / k
            else:
                total = total / k ** 2  # .grad holds Σ g_i, not yet divided by k
        s, cn = self._scale, self._world_size * k
        grad_var = local_sqr * (s / cn) / (cn - 1) - total * s / (cn - 1)  # 0.4.13's order of operations
        grad_sqr = total - grad_var / s
        self._update_avg("grad_sqr_avg", np.maximum(grad_sqr, 0.0), self._smoothing)
        self._update_avg("grad_var_avg", np.maximum(grad_var, 1e-6), self._smoothing)
        self._last_final_backward_call = self._num_backward_calls
        self._local_grad_sqr = None

    def _update_avg(self, name: str, value: np.ndarray, factor: float) -> None:
        state = self._state
        if self._debias_ewma:
            biased = factor * state.get(name + "_biased", np.zeros_like(value)) + (1.0 - factor) * value
            unbias = factor * state.get(name + "_unbias", np.zeros_like(value)) + (1.0 - factor)
            state[name + "_biased"], state[name + "_unbias"] = biased, unbias
            state[name] = biased / unbias
            return
        count = state.get(name + "_count", np.zeros(1)) + 1
        state[name + "_count"] = count
        if count[0] < 1.0 / (1.0 - self._smoothing):  # plain average while the window fills
            total = state.get(name + "_total", np.zeros_like(value)) + value
            state[name + "_total"] = total
            state[name] = total / count[0]
        else:
            state[name] = factor * state[name] + (1.0 - factor) * value

    def _grad_sqr_avg(self, pg_idx: int | None = None) -> float:
        """Smoothed μ², the squared norm of the true gradient (of ``pg_idx``, or summed over groups)."""
        sqr = self._state["grad_sqr_avg"]
        return float(sqr[pg_idx]) if pg_idx is not None else float(np.sum(sqr))

    def _grad_var_avg(self, pg_idx: int | None = None) -> float:
        """Smoothed σ², the trace of one base batch's gradient covariance."""
        var = self._state["grad_var_avg"]
        return float(var[pg_idx]) if pg_idx is not None else float(np.sum(var))

    def gain(self, pg_idx: int | None = None) -> float:
        """``(σ² + μ²) / (σ²/S + μ²)`` of param group ``pg_idx``, or of all groups' summed estimates."""
        var, sqr = self._grad_var_avg(pg_idx), self._grad_sqr_avg(pg_idx)
        return (var + sqr) / (var / self._scale + sqr)

    # ---------------------------------------------------------------------------------- scale

    @property
    def scale(self) -> float:
        """``S``: how many base batches one step's batch is."""
        return self._scale

    @property
    def smoothing(self) -> float:
        return self._smoothing

    def set_scale(self, scale: float, update_estimate: bool = True) -> None:
        """Set ``S``. With ``update_estimate`` the variance estimate is rescaled by ``old S / new S``
        (it was estimated through ``S``; recommended)."""
        assert self._local_grad_sqr is None, "don't change the scale between backward passes of one step"
        if scale < 1:
            raise ValueError(f"AdaScale scale must be >= 1, got {scale}")
        if update_estimate and hasattr(self, "_scale"):
            ratio = self._scale / scale
            for key in ("grad_var_avg_biased" if self._debias_ewma else "grad_var_avg_total", "grad_var_avg"):
                if key in self._state:
                    self._state[key] = self._state[key] * ratio
        self._scale = scale  # as given: 0.4.13 keeps an int scale an int

    def set_num_gradients_to_accumulate(self, num_gradients_to_accumulate: int, update_smoothing: bool = True) -> None:
        """Change the backward passes per step (call ``set_scale`` too, usually); ``update_smoothing``
        resets ``smoothing`` to ``max(1 − world_size × k / 1000, 0)``."""
        assert self._local_grad_sqr is None, "don't change num_gradients_to_accumulate between backward passes"
        if num_gradients_to_accumulate < 1:
            raise ValueError(f"num_gradients_to_accumulate must be >= 1, got {num_gradients_to_accumulate}")
        self._num_grads_to_accum = int(num_gradients_to_accumulate)
        if update_smoothing:
            self._smoothing = max(1.0 - self._world_size * self._num_grads_to_accum / 1000.0, 0.0)

    def scale_grad_by_num_grads_to_accum(self) -> None:
        """Divide the accumulated gradients by ``num_gradients_to_accumulate`` (for
        ``is_scaled_loss=False``, after the last backward pass of a step, before ``step()``)."""
        assert self._local_grad_sqr is None, "call this after the step's last backward pass"
        if self._num_grads_to_accum <= 1:
            raise AssertionError("scale_grad_by_num_grads_to_accum needs num_gradients_to_accumulate > 1")
        if self._is_scaled_loss:
            raise AssertionError("scale_grad_by_num_grads_to_accum is for is_scaled_loss=False: the scaled losses "
                                 "already gave mean gradients")
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(self._num_grads_to_accum)

    # ---------------------------------------------------------------------------------- optimizer

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)`` with each group's learning rate times its gain."""
        assert self._local_grad_sqr is None, "step() before the step's last backward pass ended"
        saved = [group["lr"] for group in self._optimizer.param_groups]
        for idx, group in enumerate(self._optimizer.param_groups):
            group["lr"] = group["lr"] * self.gain(pg_idx=idx)
        try:
            return self._optimizer.step(*args, **kwargs)
        finally:
            for group, lr in zip(self._optimizer.param_groups, saved):
                group["lr"] = lr

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its estimates start at μ² = 1, σ² = 0."""
        assert self._local_grad_sqr is None, "don't add a param group between backward passes"
        self._optimizer.add_param_group(param_group)
        self.unhook()
        self._hook()
        for name, value in list(self._state.items()):
            if not name.endswith("_count"):
                self._state[name] = np.append(value, 1.0 if name == "grad_sqr_avg" else 0.0)

    def zero_grad(self, set_to_none: bool = True) -> None:
        assert self._local_grad_sqr is None, "don't zero_grad between backward passes of one step"
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, AdaScale's estimates included (not mid-accumulation)."""
        assert self._local_grad_sqr is None, "don't checkpoint between backward passes of one step"
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        assert self._local_grad_sqr is None, "don't load a checkpoint between backward passes of one step"
        self._optimizer.load_state_dict(state_dict)

    # ---------------------------------------------------------------------------------- diagnostics

    def _gather_flat_grad(self) -> torch.Tensor:
        """All gradients as one vector (zeros for parameters without one)."""
        flats = []
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                flats.append(torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if g is None
                             else (g.to_dense() if g.is_sparse else g).reshape(-1))
        return torch.cat(flats)

    def _compute_intra_grad_corr_mean(self) -> torch.Tensor:
        """Mean Pearson correlation between the ranks' local gradients (call under DDP's ``no_sync()``,
        before they are averaged); every rank gets the value."""
        assert self._world_size > 1, "the correlation between ranks needs world_size > 1"
        flat = self._gather_flat_grad()
        gathered = [torch.zeros_like(flat) for _ in range(self._world_size)] if dist.get_rank() == 0 else None
        dist.gather(flat, gather_list=gathered, dst=0)
        corr_mean = torch.zeros((), dtype=flat.dtype, device=flat.device)
        if gathered is not None:
            corr = torch.stack(gathered).corrcoef()
            corr_mean = corr[torch.ones_like(corr).triu(diagonal=1) == 1].mean()
        dist.broadcast(corr_mean, src=0)
        return corr_mean

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks come from the wrapped optimizer."""
        try:
            return super().__getattr__(name)  # type: ignore[misc]
        except AttributeError:
            optimizer = self.__dict__.get("_optimizer")
            if optimizer is None:
                raise
            return getattr(optimizer, name)


class AdaScaleWrapper(AdaScale):
    """``AdaScale(optim_cls(params, **additional_optim_args), ...)``, constructed like an optimizer,
    so that it can be the class an ``OSS`` builds per shard (``OSS(params, AdaScaleWrapper,
    optim_cls=SGD, lr=0.1)``; each rank then scales by its own shard's gain)."""

    def __init__(self, params: Any, world_size: int | None = None, scale: float | None = None,
                 smoothing: float | None = None, num_gradients_to_accumulate: int = 1, debias_ewma: bool = True,
                 optim_cls: type[torch.optim.Optimizer] = torch.optim.SGD, **additional_optim_args: Any) -> None:
        super().__init__(optim_cls(params, **additional_optim_args), world_size=world_size, scale=scale,
                         smoothing=smoothing, num_gradients_to_accumulate=num_gradients_to_accumulate,
                         debias_ewma=debias_ewma)

