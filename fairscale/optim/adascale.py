"""AdaScale: adaptive learning-rate gain for large-batch SGD (FairScale 0.4.13's ``fairscale.optim.AdaScale``).

Johnson, Agrawal, Gu, Guestrin 2020, "AdaScale SGD: A User-Friendly Algorithm for Distributed
Training" (ICML). With ``S`` gradients per step (ranks × accumulated backward passes), each the
gradient ``g_i`` of one base-size batch, and their mean ``ḡ``, the per-step gain is (eq. 3)::

    r = (σ² + μ²) / (σ²/S + μ²)

where σ² = E‖g_i − E g‖² (variance of one base-batch gradient) and μ² = ‖E g‖². Unbiased estimates
from one step (section 3.3)::

    σ̂² = S/(S−1) · ( (1/S) Σ_i ‖g_i‖²  −  ‖ḡ‖² )
    μ̂² = ‖ḡ‖² − σ̂²/S

Both are smoothed with a bias-corrected exponential moving average (factor ``smoothing``) per
param group, and clamped (σ̂² ≥ 1e-6, μ̂² ≥ 0) before the gain is formed. ``step()`` multiplies each
group's learning rate by its gain for that step only::

    optim = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1))   # scale = world size
    loss.backward()            # gradients all-reduced (averaged) by DDP or by hand
    optim.step()

Gradients: with ``num_gradients_to_accumulate = k > 1``, call backward ``k`` times and then
``step()``; the accumulated ``.grad`` is the *sum* of the k backward passes and ``step()`` divides
it by ``k`` before updating, so the update uses the mean gradient ``ḡ``.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from fairscale.optim.oss import OSS, axis_for_group
from passes.ops import comm

__all__ = ["AdaScale", "AdaScaleWrapper"]


class AdaScale(torch.optim.Optimizer):
    """Wrap ``optimizer`` to scale its learning rate by the AdaScale gain each step.

    Args:
        optimizer: the wrapped optimizer (SGD in the paper; any torch optimizer works).
        world_size: number of data-parallel ranks whose gradients are averaged (default: the
            torch.distributed world size, or 1).
        scale: ``S``, the batch-size multiple over the base batch (default
            ``world_size * num_gradients_to_accumulate``).
        smoothing: EMA factor for the σ² and μ² estimates (``None``: ``max(1 − S/1000, 0)``
            with S = world_size × num_gradients_to_accumulate, FairScale's rule).
        num_gradients_to_accumulate: backward passes per ``step()``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, world_size: int | None = None, scale: float | None = None,
                 smoothing: float | None = 0.999, num_gradients_to_accumulate: int = 1,
                 debias_ewma: bool = True) -> None:
        if isinstance(optimizer, OSS):
            raise NotImplementedError("AdaScale over OSS is not supported: OSS shards gradients, and AdaScale "
                                      "needs every rank's full local gradient; use AdaScale with a plain optimizer "
                                      "and DistributedDataParallel")
        if num_gradients_to_accumulate < 1:
            raise ValueError(f"num_gradients_to_accumulate must be >= 1, got {num_gradients_to_accumulate}")
        self._optimizer = optimizer
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
        if smoothing is None:  # FairScale's rule: shorter memory when each step averages more batches
            smoothing = max(1.0 - world_size * num_gradients_to_accumulate / 1000.0, 0.0)
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self._world_size = int(world_size)
        self._axis: str | None = None
        if self._world_size > 1:
            if not dist.is_initialized() or dist.get_world_size() != self._world_size:
                raise ValueError(f"AdaScale(world_size={world_size}) needs torch.distributed initialized with "
                                 f"that many ranks (it all-reduces the per-rank gradient norms)")
            self._axis = axis_for_group(None, prefix="adascale")
        self._num_grads_to_accum = int(num_gradients_to_accumulate)
        self._smoothing = float(smoothing)
        self._debias_ewma = bool(debias_ewma)
        self._scale = 1.0
        self.set_scale(float(scale) if scale is not None else float(self._world_size * self._num_grads_to_accum),
                       update_estimate=False)
        n = len(self._optimizer.param_groups)
        self._state: dict[str, Any] = {}
        self._reset_estimates(n)
        self._local_grad_sqr = torch.zeros(n, dtype=torch.float64)
        self._num_backward_calls = 0
        self._hooks: list[Any] = []
        self._register_hooks()

    # ---------------------------------------------------------------------- Optimizer surface

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._register_hooks()
        grow = len(self._optimizer.param_groups) - len(self._local_grad_sqr)
        self._local_grad_sqr = torch.cat([self._local_grad_sqr, torch.zeros(grow, dtype=torch.float64)])
        for key in list(self._state):
            self._state[key] = np.concatenate([self._state[key], np.zeros(grow)])

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self._optimizer.state_dict(), "adascale": {k: np.array(v) for k, v in self._state.items()},
                "scale": self._scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict["optimizer"])
        self._state = {k: np.array(v) for k, v in state_dict["adascale"].items()}
        self._scale = float(state_dict["scale"])

    # ---------------------------------------------------------------------- scale and gain

    @property
    def scale(self) -> float:
        """``S``: how many base batches one step averages."""
        return self._scale

    @property
    def smoothing(self) -> float:
        return self._smoothing

    def set_scale(self, scale: float, update_estimate: bool = True) -> None:
        """Set ``S``. The σ² and μ² estimates describe one base batch, so they stay valid across a
        change of scale and are kept with ``update_estimate=True``; ``False`` restarts them."""
        if scale < 1:
            raise ValueError(f"AdaScale scale must be >= 1, got {scale}")
        self._scale = float(scale)
        if not update_estimate and hasattr(self, "_state"):
            self._reset_estimates(len(self._optimizer.param_groups))

    def set_num_gradients_to_accumulate(self, num_gradients_to_accumulate: int, update_smoothing: bool = True) -> None:
        """Change the backward passes per step; the scale follows (world size × accumulation)."""
        self._num_grads_to_accum = int(num_gradients_to_accumulate)
        self.set_scale(float(self._world_size * self._num_grads_to_accum))

    def _reset_estimates(self, n: int) -> None:
        self._state = {k: np.zeros(n) for k in ("grad_sqr_avg_biased", "grad_sqr_avg_unbias",
                                                  "grad_var_avg_biased", "grad_var_avg_unbias")}
        self._state["grad_sqr_avg"] = np.ones(n)
        self._state["grad_var_avg"] = np.zeros(n)

    def _update_avg(self, name: str, value: np.ndarray, factor: float) -> None:
        if self._debias_ewma:
            biased = factor * self._state[name + "_biased"] + (1.0 - factor) * value
            unbias = factor * self._state[name + "_unbias"] + (1.0 - factor)
            self._state[name + "_biased"], self._state[name + "_unbias"] = biased, unbias
            self._state[name] = biased / unbias
        else:
            self._state[name] = factor * self._state[name] + (1.0 - factor) * value

    def gain(self, pg_idx: int | None = None) -> float:
        """``(σ² + μ²) / (σ²/S + μ²)`` from the smoothed estimates (summed over groups if ``pg_idx`` is None)."""
        var, sqr = self._state["grad_var_avg"], self._state["grad_sqr_avg"]
        if pg_idx is None:
            v, s = float(np.sum(var)), float(np.sum(sqr))
        else:
            v, s = float(var[pg_idx]), float(sqr[pg_idx])
        if self._scale == 1.0:
            return 1.0
        return (v + s) / (v / self._scale + s)

    def _grad_sqr_avg(self, pg_idx: int | None = None) -> float:
        sqr = self._state["grad_sqr_avg"]
        return float(np.sum(sqr) if pg_idx is None else sqr[pg_idx])

    def _grad_var_avg(self, pg_idx: int | None = None) -> float:
        var = self._state["grad_var_avg"]
        return float(np.sum(var) if pg_idx is None else var[pg_idx])

    # ---------------------------------------------------------------------- statistics

    def _register_hooks(self) -> None:
        for idx, group in enumerate(self._optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    self._hooks.append(p.register_hook(self._make_hook(idx)))

    def _make_hook(self, idx: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            # the local gradient of one backward pass, before any data-parallel reduction
            self._local_grad_sqr[idx] += grad.detach().double().pow(2).sum().cpu()
        return hook

    def _update_estimates(self) -> None:
        """Fold this step's ``Σ‖g_i‖²`` and ``‖ḡ‖²`` into the smoothed σ², μ² (see the module docstring)."""
        cnt = self._world_size * self._num_grads_to_accum
        local = self._local_grad_sqr.clone()
        if self._axis is not None:
            comm.all_reduce_(local, self._axis)
        total = torch.zeros_like(local)
        for idx, group in enumerate(self._optimizer.param_groups):
            for p in group["params"]:
                if p.grad is not None:
                    total[idx] += p.grad.detach().double().pow(2).sum().cpu()
        self._local_grad_sqr.zero_()
        if cnt == 1:
            return  # one gradient: no variance to estimate, gain stays 1 at S = 1
        s = float(cnt)
        mean_sqr = local.numpy() / s
        total_sqr = total.numpy()
        grad_var = s / (s - 1.0) * (mean_sqr - total_sqr)
        grad_sqr = total_sqr - grad_var / s
        grad_var = np.maximum(grad_var, 1e-6)
        grad_sqr = np.maximum(grad_sqr, 0.0)
        self._update_avg("grad_sqr_avg", grad_sqr, self._smoothing)
        self._update_avg("grad_var_avg", grad_var, self._smoothing)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Average accumulated gradients, update the estimates, step with ``lr × gain`` per group."""
        if closure is not None:
            raise NotImplementedError("AdaScale.step(closure) is not supported: run forward/backward, then step()")
        if self._num_grads_to_accum > 1:
            for group in self._optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.div_(self._num_grads_to_accum)
        self._update_estimates()
        original = []
        for idx, group in enumerate(self._optimizer.param_groups):
            original.append(group["lr"])
            group["lr"] = group["lr"] * self.gain(idx)
        try:
            return self._optimizer.step()
        finally:
            for group, lr in zip(self._optimizer.param_groups, original):
                group["lr"] = lr


def AdaScaleWrapper(params: Any, world_size: int | None = None, scale: float | None = None,
                    optim_cls: type[torch.optim.Optimizer] = torch.optim.SGD, **kwargs: Any) -> AdaScale:
    """``AdaScale(optim_cls(params, **kwargs), world_size, scale)``, as FairScale's AdaScaleWrapper."""
    return AdaScale(optim_cls(params, **kwargs), world_size=world_size, scale=scale)
