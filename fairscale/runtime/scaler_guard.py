"""``torch.amp.GradScaler`` driving ``pm.optimizer``: gradients unscaled and infs found over the whole model.

``GradScaler.unscale_`` (and ``step``, which calls it) looks for the gradients in the optimizer's
``param_groups`` and checks them for infs on its own rank. A rank's ``pm.optimizer`` under ZeRO-2
or FSDP is handed its gradients only when it steps, so ``scaler.step(pm.optimizer)`` failed after
launch ("No inf checks were recorded for this optimizer"); and where the gradients were found, an
inf in one rank's slice or shard would have made that rank alone skip its step. Once a
ParallelModule exists, the scaler's ``_unscale_grads_`` for a live module's ``pm.optimizer``
multiplies the gradients that optimizer steps by the inverse scale (as ``pm.clip_grad_norm_``
scales them) and finds infs and nans over every rank of the module (a flag reduced over its mesh
axes), so every rank skips or steps alike, as one process does::

    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(pm(*batch)).backward()
    scaler.unscale_(pm.optimizer); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(pm.optimizer); scaler.update(); pm.optimizer.zero_grad()

Collective: every rank unscales alike, as every rank runs the same script.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.amp

from fairscale.runtime.optim import merge_grad_norm_parts, reduce_grad_norm

__all__ = ["guard_grad_scaler"]

_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()
_TORCH = torch.amp.GradScaler._unscale_grads_


def guard_grad_scaler(pm: Any) -> None:
    """Have ``torch.amp.GradScaler`` unscale ``pm.optimizer`` over the whole module."""
    _LIVE.add(pm)
    torch.amp.GradScaler._unscale_grads_ = _unscale_grads_  # type: ignore[method-assign]


def _unscale_grads_(self: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                    found_inf: torch.Tensor, allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
    pm = next((m for m in list(_LIVE) if not m.retired and m.optimizer is optimizer), None)
    if pm is None:
        return _TORCH(self, optimizer, inv_scale, found_inf, allow_fp16)
    with torch.no_grad(), pm.mesh.groups.active():
        parts = merge_grad_norm_parts((opt.grad_norm_parts(math.inf) for opt in pm._optimizers), math.inf)
        flags = {axes: (~torch.isfinite(v)).to(torch.float64) for axes, v in parts.items()}  # a nan survives as 1
        found = reduce_grad_norm(flags, math.inf, reduce_axes=("pp",))
        for opt in pm._optimizers:
            opt.scale_grads_(inv_scale)
    found_inf.copy_(found.to(found_inf.device, found_inf.dtype))
    return {found_inf.device: found_inf}
