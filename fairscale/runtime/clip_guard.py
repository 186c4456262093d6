"""``torch.nn.utils.clip_grad_norm_`` on a ParallelModule's parameters clips by the GLOBAL norm.

A rank holds slices and shards of the model (tp, ep, ZeRO/FSDP, pipeline stages), so torch's
function, given ``pm.parameters()``, would clip with the norm of this rank's pieces: a different
coefficient on every rank, a silent difference from one process. Once a ParallelModule exists,
``torch.nn.utils.clip_grad_norm_`` (the attribute, looked up when called) is this module's
:func:`clip_grad_norm_`:

* given exactly a live ParallelModule's parameters, it is ``pm.clip_grad_norm_(max_norm,
  norm_type, error_if_nonfinite=...)``: the norm of the whole model, every element once, the same on every rank
  (collective: every rank calls it, as every rank runs the same script);
* given the parameters of the model it was built from (``model.parameters()``, as nanoGPT and
  most loops write it; frozen ones may be left out), the same: those tensors get no gradients
  once parallelized, so torch's function had returned 0 and clipped nothing, silently;
* given some of them, or some mixed with other tensors, it raises and says what to call instead;
* anything else goes to torch's own function unchanged.

``torch.nn.utils.clip_grad_value_`` is elementwise, so torch's function on ``pm.parameters()`` is
exact already; given the model's parameters (no gradients once parallelized: torch's function
crashed in its foreach kernels, 'Expected !nested_tensorlist[0].empty()'), it clips
``pm.parameters()``'s, and given some of them it raises, as above.

A name bound before the first ParallelModule (``from torch.nn.utils import clip_grad_norm_`` at
the top of a script) is torch's own function and is not covered: ``pm.clip_grad_norm_`` (or
``train_step(batch, clip_norm=...)``) is the documented way.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Iterable

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from fairscale.runtime.grad_none_guard import guard_grad_none
from fairscale.runtime.model_owners import own
from fairscale.runtime.scaler_guard import guard_grad_scaler
from fairscale.runtime.user_optimizer import guard_new_optimizers
from fairscale.runtime.zero_grad_guard import guard_zero_grad

__all__ = ["guard_clip_grad_norm", "clip_grad_norm_", "clip_grad_value_"]

_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()
_TORCH = torch.nn.utils.clip_grad.clip_grad_norm_
_TORCH_VALUE = torch.nn.utils.clip_grad.clip_grad_value_


def guard_clip_grad_norm(pm: Any) -> None:
    """Route torch's ``clip_grad_norm_`` for ``pm``'s parameters to ``pm.clip_grad_norm_``."""
    _LIVE.add(pm)
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    guard_grad_scaler(pm)  # torch.amp.GradScaler(...).unscale_(pm.optimizer) too (fairscale.runtime.scaler_guard)
    guard_zero_grad(pm)  # and model.zero_grad() clears pm's gradients (fairscale.runtime.zero_grad_guard)
    guard_new_optimizers(pm)  # and an optimizer built over the model afterwards refuses to step
    guard_grad_none(pm)  # and p.grad = None on every model parameter clears pm's (runtime.grad_none_guard)
    own(pm)  # and a later parallelize of a model sharing its trainable weights is refused (runtime.model_owners)
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad_value_ = clip_grad_value_
    torch.nn.utils.clip_grad.clip_grad_value_ = clip_grad_value_


@functools.wraps(_TORCH)
def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    given = {id(p) for p in params}
    pm = _model_owner(given, "clip_grad_norm_", "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) or "
                      "pm.clip_grad_norm_(max_norm) (or pm.train_step(batch, clip_norm=max_norm))")
    if pm is not None:
        return pm.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)
    for pm in list(_LIVE):
        if pm.retired:
            continue
        own = {id(p) for p in pm.parameters()}
        if not own & given:
            continue
        if own != given:
            raise RuntimeError(
                "torch.nn.utils.clip_grad_norm_ was given some of a ParallelModule's parameters"
                + (" and other tensors" if given - own else "") + ": this rank holds only slices and shards, so "
                "their norm is not the model's. Clip the whole model with pm.clip_grad_norm_(max_norm) (or "
                "pm.train_step(batch, clip_norm=max_norm)); it computes the global norm")
        # foreach only chooses torch's kernels: nothing to pass on
        return pm.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)
    return _TORCH(params, max_norm, norm_type, error_if_nonfinite, foreach)


@functools.wraps(_TORCH_VALUE)
def clip_grad_value_(parameters: torch.Tensor | Iterable[torch.Tensor], clip_value: float,
                     foreach: bool | None = None) -> None:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    pm = _model_owner({id(p) for p in params}, "clip_grad_value_", "torch.nn.utils.clip_grad_value_("
                      "model.parameters(), clip_value) or torch.nn.utils.clip_grad_value_(pm.parameters(), clip_value)")
    if pm is None:
        _TORCH_VALUE(params, clip_value, foreach)
        return
    mine = [p for p in pm.parameters() if p.grad is not None]  # elementwise: exact on slices and shards
    if mine:
        _TORCH_VALUE(mine, clip_value, foreach)


def _model_owner(given: set[int], what: str, whole: str) -> Any:
    """The live ParallelModule whose user's model holds the tensors ``given`` (by id), or None; raises
    when they are only some of its trainable parameters, or others too (``what``: the torch function
    called, ``whole``: how to clip the whole model instead)."""
    for pm in list(_LIVE):
        model = None if pm.retired else pm._user_model()
        if model is None or not given & (users := {id(p) for p in model.parameters()}):
            continue
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        if given - users or not trainable <= given:
            raise RuntimeError(
                f"torch.nn.utils.{what} was given some of the parameters of a model passed to "
                "fairscale.parallelize" + (" and other tensors" if given - users else "") + ": its training runs "
                "on the ParallelModule's slices and shards, and these tensors get no gradients. Clip the whole "
                f"model with {whole}")
        return pm
    return None
