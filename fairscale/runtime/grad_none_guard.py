"""``p.grad = None`` on every parameter of a parallelized model clears its ParallelModule's gradients.

PyTorch's performance guide clears gradients so (``for p in model.parameters(): p.grad = None``),
and loops written after it do. Once parallelized, the model's own tensors get no gradients (its
ranks train slices and shards), so the loop cleared nothing the ranks train: in the plain loop
(``pm(*batch).backward(); pm.optimizer.step()``, then the clearing) every step's gradients were
added to all earlier ones, and training differed from one process without a word (a dp2 MLP's
weights 7e-2 away after 3 SGD steps).

While a ParallelModule exists, ``nn.Parameter.grad`` is a property that notes a ``None`` set on a
trainable parameter of a live module's model (torch's own getter and setter do the work). When the
backward of a loss ``pm(*batch)`` returned starts, the noted clearing is applied to ``pm``: every
trainable parameter cleared, ``pm.optimizer.zero_grad(set_to_none=True)``; only some of them is
refused (a rank's slices share flat buffers with other parameters', so a part cannot be cleared
alone). ``model.zero_grad()`` is :mod:`fairscale.runtime.zero_grad_guard`'s.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from fairscale.runtime.model_guard import fairscale_inside

__all__ = ["guard_grad_none", "watch_cleared"]

_TORCH_GRAD = torch._C.TensorBase.grad
_TRACKED: dict[int, tuple["weakref.ref[Any]", "weakref.ref[Any]"]] = {}  # id(parameter) -> (parameter, pm)
_CLEARED: set[int] = set()


def _get(self: torch.Tensor) -> torch.Tensor | None:
    return _TORCH_GRAD.__get__(self)


def _set(self: torch.Tensor, value: torch.Tensor | None) -> None:
    _TORCH_GRAD.__set__(self, value)
    if value is None and id(self) in _TRACKED and _TRACKED[id(self)][0]() is self and not fairscale_inside():
        _CLEARED.add(id(self))


def _delete(self: torch.Tensor) -> None:
    _TORCH_GRAD.__delete__(self)
    _set(self, None)


def guard_grad_none(pm: Any) -> None:
    """Note ``p.grad = None`` on the trainable parameters of ``pm``'s model (read at its first call)."""
    if not isinstance(nn.Parameter.__dict__.get("grad"), property):
        nn.Parameter.grad = property(_get, _set, _delete, _TORCH_GRAD.__doc__)  # type: ignore[assignment]


def _track(pm: Any, model: nn.Module) -> list[nn.Parameter]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        if id(p) not in _TRACKED or _TRACKED[id(p)][0]() is not p:
            _TRACKED[id(p)] = (weakref.ref(p), weakref.ref(pm))
    return trainable


def watch_cleared(pm: Any, loss: torch.Tensor) -> None:
    """Apply a clearing noted since the last backward when ``loss``'s backward starts."""
    model = pm._user_model()
    if model is None or not loss.requires_grad:
        return
    _track(pm, model)

    def apply(grad: torch.Tensor) -> torch.Tensor:
        live = _track(pm, model)
        cleared = [p for p in live if id(p) in _CLEARED]
        if not cleared:
            return grad
        _CLEARED.difference_update(id(p) for p in live)
        if len(cleared) < len(live):
            names = [n for n, p in model.named_parameters() if any(p is q for q in cleared)]
            raise RuntimeError(
                f"p.grad = None was set on {len(cleared)} of the {len(live)} trainable parameters of the model passed "
                f"to fairscale.parallelize (e.g. {', '.join(names[:3])}): its training runs on the ParallelModule's "
                "slices and shards, whose gradients are cleared for the whole model at once; clear every parameter's, "
                "or call pm.optimizer.zero_grad()")
        pm.optimizer.zero_grad(set_to_none=True)
        return grad

    loss.register_hook(apply)
