"""The model's train/eval mode against the mode its rank graphs were compiled in.

``torch.export`` bakes each module's mode into the graph, so a rank runs the mode the model was in
when ``fairscale.parallelize`` captured it. Scripts toggle the mode the PyTorch way::

    model.eval()
    with torch.no_grad():
        val = pm(*val_batch)      # eval mode: the rank's graphs rewritten as pm.evaluate runs them
    model.train()
    pm.train_step(batch)          # the compiled training mode again

``pm(*batch)`` with every module in eval mode and autograd off runs the eval-mode graphs; any other
call made while a module's mode differs from the compiled one is refused, naming the module. They
had run the compiled mode without a word: a validation forward after ``model.eval()`` used batch
statistics and updated batch norm's running statistics, and a model compiled in eval mode (as
Hugging Face's ``from_pretrained`` returns it) trained with dropout off after ``model.train()``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

from torch import nn

__all__ = ["ModeError", "modes_of", "mode_change", "all_eval", "compiled_modes", "attributes_kept", "forward_set"]


class ModeError(RuntimeError):
    """A module's train/eval mode differs from the one its rank graphs were compiled in."""


def modes_of(model: nn.Module) -> tuple[bool, ...]:
    """Every module's ``training`` flag, in ``model.modules()`` order."""
    return tuple(m.training for m in model.modules())


def forward_set(model: nn.Module, modes: tuple[bool, ...], names: Sequence[str]) -> tuple[bool | None, ...]:
    """``modes`` with None for the modules ``names`` (``planner.mode_setters``): their mode is the one
    the forward sets, whatever their flag, so no flag of theirs is compiled or checked."""
    setters = set(names)
    return tuple(None if name in setters else flag for (name, _), flag in
                 zip(model.named_modules(), modes))


def all_eval(model: nn.Module) -> bool:
    return not any(modes_of(model))


def _mode(training: bool) -> str:
    return "training" if training else "eval"


def mode_change(model: nn.Module, compiled: tuple[bool | None, ...]) -> str | None:
    """What differs between ``model``'s modes now and ``compiled`` (:func:`modes_of` at compile
    time), in words; None when nothing does (or the modes were not recorded)."""
    now = modes_of(model)
    if not compiled or len(now) != len(compiled) or now == compiled:
        return None
    names = [name for name, _ in model.named_modules()]
    differ = [(name, was) for name, was, is_ in zip(names, compiled, now) if was is not None and was != is_]
    if not differ:
        return None
    name, was = differ[0]
    where = f"module {name} ({type(model.get_submodule(name)).__name__})" if name else \
        f"the model ({type(model).__name__})"
    more = f", and {len(differ) - 1} more module(s) changed mode" if len(differ) > 1 else ""
    return (f"{where} is in {_mode(not was)} mode, but was in {_mode(was)} mode when fairscale.parallelize "
            f"compiled it{more}")


@contextlib.contextmanager
def compiled_modes(model: nn.Module, modes: tuple[bool | None, ...]) -> Iterator[None]:
    """Run the block with ``model``'s modules in ``modes`` (nothing changes when they were not
    recorded); each module's own flag is restored afterwards."""
    modules = list(model.modules())
    if not modes or len(modes) != len(modules):
        yield
        return
    flags = [m.training for m in modules]
    try:
        for m, flag in zip(modules, modes):
            m.training = m.training if flag is None else flag
        yield
    finally:
        for m, flag in zip(modules, flags):
            m.training = flag


@contextlib.contextmanager
def attributes_kept(model: nn.Module) -> Iterator[None]:
    """Run the block, then put back every attribute of ``model``'s modules as it was bound before
    (training flags, and what a forward rebinds: HF ``RwkvModel``'s ``layers_are_rescaled`` set by
    an eval-mode forward, which the next training capture would read); attributes the block added
    are removed. Shallow: a container mutated in place stays mutated."""
    saved = [(m, dict(m.__dict__)) for m in model.modules()]
    try:
        yield
    finally:
        for m, attributes in saved:
            m.__dict__.clear()
            m.__dict__.update(attributes)
