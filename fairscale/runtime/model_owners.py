"""What ``fairscale.parallelize`` refuses to start from: a model behind its ranks, or weights another module trains.

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

Two models sharing trainable parameters, each parallelized (a GAN's discriminator loss
``D(real), D(G(z).detach())`` and generator loss ``D(G(z))``, each a module holding both nets), had
each module train its own copy of the shared weights, so the discriminator the generator trained
against never moved, silently: :func:`check_owned` refuses such a model at ``parallelize``, before
anything is captured, while the other module is open.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

from torch import nn

from fairscale.runtime.model_guard import StaleModelError, behind_since, fairscale_inside

__all__ = ["SharedWeightsError", "NotCopied", "own", "check_owned", "started_behind", "refuse_behind"]

_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()
_BEHIND: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_CALLS = {"_step": "pm.train_step", "__call__": "pm(*batch)"}


class SharedWeightsError(RuntimeError):
    """A model given to ``fairscale.parallelize`` shares trainable weights with another live ParallelModule's."""


class NotCopied:
    """A ParallelModule is neither copied nor pickled: ``copy.deepcopy(pm)`` had made a module whose
    first call failed inside its optimizer (``'StageOptimizers' object has no attribute '_groups'``),
    and ``torch.save(pm)`` failed on a weak reference; each now says what to do instead."""

    def _refuse(self, what: str) -> None:
        raise TypeError(
            f"{what} of a ParallelModule: it is this rank's part of a model trained on all ranks (its slices, shards, "
            "optimizer state and process groups), which a copy could not share. Save it with pm.save_checkpoint(dir) "
            "(every rank; any plan resumes it) or pm.state_dict() (the full state dict, on rank 0); for a second "
            "model (an EMA or a teacher), copy the model before fairscale.parallelize, or pm.gather_into(model) and "
            "copy that, and parallelize the copy")

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        self._refuse("copy.deepcopy")

    def __copy__(self) -> Any:
        self._refuse("copy.copy")

    def __reduce_ex__(self, protocol: Any) -> Any:
        self._refuse("pickling (torch.save)")


def own(pm: Any) -> None:
    """``pm`` trains copies of its model's weights until it is retired or collected."""
    _LIVE.add(pm)


def check_owned(model: nn.Module) -> str:
    """Raise if ``model`` shares a trainable parameter with the model of another live
    ParallelModule; return why it is behind a ParallelModule's ranks ("" when it is not)."""
    mine = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    found = _shared(model, mine)
    if found is not None:  # a module the script dropped (del pm) but a cycle keeps holds nothing: collect first
        gc.collect()  # (only here: a full collection in every rank forked from a large process is slow)
        found = _shared(model, mine)
    if found is not None:
        other, shared = found
        listed = ", ".join(dict.fromkeys(shared[:4])) + (" ..." if len(shared) > 4 else "")
        raise SharedWeightsError(
            f"fairscale.parallelize: the {type(model).__name__} given shares trainable parameters ({listed}) with "
            f"the {type(other).__name__} of a ParallelModule that is still open; each ParallelModule trains its "
            "own copy of its model's weights on its ranks, so what one trains never reaches the other (a GAN's "
            "generator loss would run against a discriminator that never moves; two losses stepped in turn over "
            "the same weights cannot be split over two modules). Parallelize one model whose forward computes "
            "the loss over all of them, or close the other module first (pm.close(), every rank); parameters "
            "frozen (requires_grad=False) in both may be shared")
    for path, module in model.named_modules():
        why = behind_since(module)
        if why:
            return f"{f'its submodule {path}' if path else 'the model'} ({type(module).__name__}) was behind since {why}"
    return ""


def _shared(model: nn.Module, mine: dict[int, str]) -> tuple[nn.Module, list[str]] | None:
    """The model of a live ParallelModule (not ``model`` itself) that shares a trainable parameter with
    ``model`` (``mine``: its parameters' ids and names), and the names of those; None if none does."""
    for pm in list(_LIVE):
        other = None if pm.retired else pm._user_model()
        if other is None or other is model:  # the same model again: behind (below) once its module trained
            continue
        compiled = dict(pm.rank_program.trainable)
        shared = [mine[id(p)] for name, p in other.named_parameters(remove_duplicate=False)
                  if id(p) in mine and (p.requires_grad or compiled.get(name, False))]
        if shared:
            return other, shared
    return None


def started_behind(pm: Any, model: nn.Module, why: str) -> None:
    """``pm`` was built from ``model``, which was behind another module's ranks (:func:`check_owned`'s
    ``why``, "" if not); a ``model.load_state_dict`` while ``model`` is current is noted too."""
    if why:
        _BEHIND[pm] = (
            f"this ParallelModule was built by fairscale.parallelize from weights that are not the trained ones "
            f"({why}): the model keeps the weights it had when the earlier ParallelModule was built from it, so this "
            "module would go on from there, the steps taken lost. Call pm.gather_into(model) on every rank (with the "
            "earlier module) before parallelizing the model again, change a running module's plan with "
            "fairscale.switch_plan(pm, plan), or resume this one with pm.load_checkpoint(dir); after pm.close(), load "
            "the weights to start from with model.load_state_dict(...) before fairscale.parallelize")
    model.register_load_state_dict_pre_hook(_LoadWatch(pm))


class _LoadWatch:
    """A load_state_dict pre-hook noting a load into the model while it is current: ``pm`` would
    never train the loaded weights. Pickled (``torch.save(model)``), it does nothing."""

    def __init__(self, pm: Any) -> None:
        self.owner = weakref.ref(pm) if pm is not None else None

    def __call__(self, module: nn.Module, *_: Any) -> None:
        held = self.owner() if self.owner is not None else None
        if held is None or held.retired or fairscale_inside() or behind_since(module):
            return  # behind: a load of the ranks' weights (pm.state_dict() on rank 0) makes it current
        _BEHIND[held] = (
            f"model.load_state_dict(...) loaded weights into the {type(module).__name__} after fairscale.parallelize "
            "built this ParallelModule from it, whose ranks train their own copy of the weights it had then: the "
            "loaded weights would never be trained. Load them before fairscale.parallelize, or into this module with "
            "pm.load_checkpoint(dir)")

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return _LoadWatch, (None,)

    def __deepcopy__(self, memo: dict[int, Any]) -> "_LoadWatch":
        return self


def refuse_behind(pm: Any, call: str) -> None:
    """Raise if ``pm`` holds other weights than its model's (:func:`started_behind`), unless ``call``
    is ``load_checkpoint``, which replaces them (``memory_report`` reads none)."""
    why = _BEHIND.get(pm)
    if not why or call == "memory_report":
        return
    if call == "load_checkpoint":
        del _BEHIND[pm]
        return
    raise StaleModelError(f"{_CALLS.get(call, f'pm.{call}')}: {why}")
