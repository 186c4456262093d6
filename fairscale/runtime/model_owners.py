"""What ``fairscale.parallelize`` refuses to start from: a model behind its ranks.

Each ParallelModule trains its own copy of its model's weights on its ranks, from the values the
model holds when ``parallelize`` reads them; the model keeps those values
(:mod:`fairscale.runtime.model_guard`). A script that parallelized the model again after a
ParallelModule built from it had trained (another plan mid-script, or after ``pm.close()``, or
once the first module was garbage-collected) trained the second module from the initial weights,
the steps already taken lost, silently.

:func:`check_owned` finds it before anything is captured, and the new module is refused at its
first call (:func:`refuse_behind`: ``train_step``, ``pm(*batch)``, ``evaluate``, ``state_dict``,
...), before any weight moves, unless ``pm.load_checkpoint`` comes first (a run resumed under
another plan in the same process starts from the checkpoint's weights).
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from fairscale.runtime.model_guard import StaleModelError, behind_since

__all__ = ["check_owned", "started_behind", "refuse_behind"]

_BEHIND: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_CALLS = {"_step": "pm.train_step", "__call__": "pm(*batch)"}


def check_owned(model: nn.Module) -> str:
    """Why ``model`` is behind a ParallelModule's ranks ("" when it is not)."""
    for path, module in model.named_modules():
        why = behind_since(module)
        if why:
            return f"{f'its submodule {path}' if path else 'the model'} ({type(module).__name__}) was behind since {why}"
    return ""


def started_behind(pm: Any, why: str) -> None:
    """``pm`` was built from a model behind another module's ranks (:func:`check_owned`'s ``why``)."""
    if why:
        _BEHIND[pm] = why


def refuse_behind(pm: Any, call: str) -> None:
    """Raise if ``pm`` holds the old weights of a model that was behind when it was built, unless
    ``call`` is ``load_checkpoint``, which replaces them (``memory_report`` reads none)."""
    why = _BEHIND.get(pm)
    if not why or call == "memory_report":
        return
    if call == "load_checkpoint":
        del _BEHIND[pm]
        return
    raise StaleModelError(
        f"{_CALLS.get(call, f'pm.{call}')}: this ParallelModule was built by fairscale.parallelize from weights that are not the "
        f"trained ones ({why}): the model keeps the weights it had when the earlier ParallelModule was built from "
        "it, so this module would go on from there, the steps taken lost. Call pm.gather_into(model) on every rank "
        "(with the earlier module) before parallelizing the model again, change a running module's plan with "
        "fairscale.switch_plan(pm, plan), or resume this one with pm.load_checkpoint(dir); after pm.close(), load "
        "the weights to start from with model.load_state_dict(...) before fairscale.parallelize")
