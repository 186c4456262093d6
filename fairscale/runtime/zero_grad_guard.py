"""``model.zero_grad()`` on a model given to ``fairscale.parallelize`` clears its ParallelModule's gradients.

Hugging Face's Trainer, and the loops written after it, clear gradients with ``model.zero_grad()``
after ``optimizer.step()``. Once parallelized, the model's own tensors get no gradients (its ranks
train slices and shards), so the call cleared nothing the ranks train: in the plain loop
(``pm(*batch).backward(); pm.optimizer.step(); model.zero_grad()``) every step's gradients were
added to all earlier ones, and training differed from one process without a word. Once a
ParallelModule exists, ``nn.Module.zero_grad`` is this module's :func:`zero_grad`:

* on the model a live ParallelModule was built from, or a module holding it (a wrapper with a
  teacher, an ``nn.ModuleDict`` of models): torch's method, then
  ``pm.optimizer.zero_grad(set_to_none)`` (local: no collective);
* on a submodule of such a model that holds trainable parameters: raises, saying to clear the
  whole model's (its slices may share flat buffers with other modules' on the ranks);
* on anything else, and in fairscale's own uses of the model: torch's method unchanged.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from torch import nn

from fairscale.runtime.model_guard import fairscale_inside

__all__ = ["guard_zero_grad", "zero_grad"]

_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()
_TORCH = nn.Module.zero_grad


def guard_zero_grad(pm: Any) -> None:
    """Make ``model.zero_grad()`` of ``pm``'s model clear ``pm``'s gradients."""
    _LIVE.add(pm)
    nn.Module.zero_grad = zero_grad  # type: ignore[method-assign]


@functools.wraps(_TORCH)
def zero_grad(self: nn.Module, set_to_none: bool = True) -> None:
    _TORCH(self, set_to_none)
    if fairscale_inside():
        return
    for pm in list(_LIVE):
        model = None if pm.retired else pm._user_model()
        if model is None:
            continue
        if self is model or any(m is model for m in self.modules()):  # or a module holding it (a wrapper)
            pm.optimizer.zero_grad(set_to_none=set_to_none)
        elif any(self is m for m in model.modules()) and any(p.requires_grad for p in self.parameters()):
            raise RuntimeError(
                f"{type(self).__name__}.zero_grad() was called on a submodule of a model passed to "
                "fairscale.parallelize: its training runs on the ParallelModule's slices and shards, whose "
                "gradients are cleared for the whole model at once: call model.zero_grad() or "
                "pm.optimizer.zero_grad()")
