"""Which parameters train: fixed when ``fairscale.parallelize`` compiles the model.

The plan and the rank graphs are built for the model's ``requires_grad`` flags at that moment:
frozen parameters stay whole on every rank with no gradient, trainable ones are sliced, sharded
and given to the optimizer. A flag changed afterwards on the user's model (a fine-tuning script
freezing an embedding, or unfreezing its backbone after an epoch) changed nothing: the rank kept
training what it compiled, without a word. ``pm.train_step`` and a ``pm(*batch)`` with autograd
on now raise :class:`FrozenChangeError` naming the parameters whose flag changed.
"""

from __future__ import annotations

from torch import nn

__all__ = ["FrozenChangeError", "trainable_of", "check_trainable"]


class FrozenChangeError(RuntimeError):
    """A parameter's ``requires_grad`` differs from when its model was parallelized."""


def trainable_of(model: nn.Module) -> tuple[tuple[str, bool], ...]:
    """(name, requires_grad) of every parameter of ``model``, in ``named_parameters()`` order."""
    return tuple((name, p.requires_grad) for name, p in model.named_parameters())


def check_trainable(model: nn.Module | None, compiled: tuple[tuple[str, bool], ...], call: str) -> None:
    """Raise if ``model``'s flags differ from ``compiled`` (:func:`trainable_of` when it was
    parallelized); nothing to check when either is missing."""
    if model is None or not compiled:
        return
    was = dict(compiled)
    changed = [(name, flag) for name, flag in trainable_of(model) if name in was and was[name] != flag]
    if not changed:
        return
    frozen = [name for name, flag in changed if not flag]
    thawed = [name for name, flag in changed if flag]
    said = "; ".join(f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''} "
                     f"{'frozen (requires_grad=False)' if names is frozen else 'unfrozen (requires_grad=True)'}"
                     for names in (frozen, thawed) if names)
    raise FrozenChangeError(
        f"{call}: parameter(s) {said} after fairscale.parallelize compiled the model, which fixed which "
        "parameters train (it would go on training them as they were). Set requires_grad before "
        "fairscale.parallelize; to change it mid-run, save with pm.save_checkpoint(dir), set the flags, "
        "parallelize the model again and resume with pm.load_checkpoint(dir)")
