"""The model given to ``fairscale.parallelize`` after its ranks have trained: stale until gathered into.

Once parallelized, the ranks train their own slices and shards; the user's ``model`` keeps the
weights it had. A script that went on with it (``model.save_pretrained(out)``,
``torch.save(model.state_dict(), path)``, ``model.generate(...)``, a validation ``model(x)``) got
the initial weights, without a word. Now, from the first optimizer step of a module built from it
(``pm.optimizer.step()``, ``pm.train_step``) or a ``pm.load_checkpoint``, until the trained weights
are copied back, the model's forward and ``state_dict()`` (of it or any of its submodules) raise
:class:`StaleModelError`, which says what to call::

    pm.gather_into(model)            # every rank (collective): the model now holds the trained weights
    if rank == 0:
        model.save_pretrained(out)

``model.load_state_dict(full)`` (every key; ``pm.state_dict()`` on rank 0, say) also makes it
current. fairscale's own uses of the model (a re-capture in ``switch_plan``, the closed loop, a
second ``parallelize``) are not refused (:func:`fairscale_uses_models`). ``torch.save(model)``
(pickling the model) raises too, and so does ``torch.optim.swa_utils.AveragedModel.update_parameters(model)``
(an EMA or SWA of its weights). A ``copy.deepcopy`` of the model is not guarded: a copy made while
it is behind holds the stale weights, as the model did when copied.
"""

from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx._symbolic_trace import is_fx_tracing
from torch.utils._pytree import tree_leaves

__all__ = ["StaleModelError", "guard_model", "is_guard", "mark_stale", "mark_current", "behind_since", "fairscale_uses_models",
           "using_models", "fairscale_inside",
           "refuse_stale_state_dict"]

F = TypeVar("F", bound=Callable[..., Any])


class StaleModelError(RuntimeError):
    """The model given to ``fairscale.parallelize`` was used while its ranks hold newer weights."""


class _State:
    """What one parallelized model lags behind: the last change the ranks made, or "" when current."""

    def __init__(self) -> None:
        self.behind = ""


_GUARDED: "weakref.WeakKeyDictionary[nn.Module, tuple[_State, str]]" = weakref.WeakKeyDictionary()
_INSIDE = [0]  # depth of fairscale's own calls that run the user's model


@contextmanager
def using_models() -> Iterator[None]:
    """fairscale's own use of the user's model: not refused."""
    _INSIDE[0] += 1
    try:
        yield
    finally:
        _INSIDE[0] -= 1


def fairscale_inside() -> bool:
    """Whether fairscale's own use of the user's model is running (:func:`using_models`)."""
    return bool(_INSIDE[0])


def fairscale_uses_models(fn: F) -> F:
    """Run ``fn`` (a fairscale entry point that captures or runs the user's model) without the guard."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with using_models():
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]


def guard_model(model: nn.Module | None) -> None:
    """Install the guard on ``model`` and its submodules (idempotent: a model already behind stays so)."""
    if model is None or model in _GUARDED:
        return
    _guard_averaging()
    state = _State()
    for path, m in model.named_modules(remove_duplicate=True):
        if m in _GUARDED:
            continue
        _GUARDED[m] = (state, path)
        m.register_forward_pre_hook(_ForwardGuard(m))
        m.register_state_dict_pre_hook(refuse_stale_state_dict)
    model.register_load_state_dict_post_hook(_on_load)


def mark_stale(model: nn.Module | None, why: str) -> None:
    """The ranks' weights moved past ``model``'s (an optimizer step, a checkpoint loaded)."""
    entry = _GUARDED.get(model) if model is not None else None
    if entry is not None:
        entry[0].behind = why


def mark_current(model: nn.Module | None) -> None:
    """``model`` holds the ranks' weights again (``pm.gather_into``, a full ``load_state_dict``)."""
    entry = _GUARDED.get(model) if model is not None else None
    if entry is not None:
        entry[0].behind = ""


def behind_since(module: nn.Module) -> str:
    """What moved the ranks past ``module``'s weights ("" when current or never parallelized)."""
    entry = _GUARDED.get(module)
    return entry[0].behind if entry is not None else ""


def _behind(module: nn.Module) -> tuple[_State, str] | None:
    entry = _GUARDED.get(module)
    return entry if entry is not None and entry[0].behind and not _INSIDE[0] else None


def _refuse(entry: tuple[_State, str], what: str) -> None:
    state, path = entry
    name = f"the parallelized model's submodule {path}" if path else "the model given to fairscale.parallelize"
    raise StaleModelError(
        f"{what} of {name}, whose weights are behind its ranks' since {state.behind}: the ranks hold the "
        "trained weights and the model its own, so this would save or run stale ones. Call pm.gather_into(model) "
        "on every rank first (collective; the model then holds the trained weights), or use pm.state_dict() (the "
        "full state dict on rank 0) or pm.evaluate(batch). After pm.close(), load a checkpoint's or "
        "pm.state_dict()'s weights into it with model.load_state_dict(...). In fairscale.train's on_step callback, "
        "take pm as its third argument")


class _ForwardGuard:
    """The guard's forward pre-hook; pickling it (``torch.save(model)``, which pickles the module
    with its hooks) is refused too while its module is behind. A ``copy.deepcopy`` shares it, and
    the copy is not guarded (it is no module of the guard's); an unpickled one does nothing."""

    def __init__(self, module: nn.Module | None) -> None:
        self.module = weakref.ref(module) if module is not None else None

    def __call__(self, module: nn.Module, args: Any) -> None:
        entry = _behind(module)
        if entry is None or is_fx_tracing() or any(isinstance(a, (FakeTensor, torch.fx.Proxy))
                                                   for a in tree_leaves(args)):
            return  # current, or a capture of the model's structure (its weights are not read)
        _refuse(entry, "forward")

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        module = self.module() if self.module is not None else None
        entry = _behind(module) if module is not None else None
        if entry is not None:
            _refuse(entry, "torch.save (pickling)")
        return _ForwardGuard, (None,)

    def __deepcopy__(self, memo: dict[int, Any]) -> "_ForwardGuard":
        return self


def _guard_averaging() -> None:
    """``AveragedModel.update_parameters(model)`` (torch's EMA and SWA) reads the model's tensors
    without a forward or a state_dict: it had averaged the initial weights at every step, silently."""
    from torch.optim.swa_utils import AveragedModel

    update = AveragedModel.update_parameters
    if getattr(update, "_fairscale_guard", False):
        return

    @functools.wraps(update)
    def update_parameters(self: AveragedModel, model: nn.Module) -> None:
        entry = _behind(model)
        if entry is not None:
            _refuse(entry, "AveragedModel.update_parameters (an average of its weights)")
        update(self, model)

    update_parameters._fairscale_guard = True  # type: ignore[attr-defined]
    AveragedModel.update_parameters = update_parameters  # type: ignore[method-assign]


def is_guard(hook: Any) -> bool:
    """Whether a module's forward pre-hook is this guard's (it changes no capture)."""
    return isinstance(hook, _ForwardGuard)


def refuse_stale_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """The guard's state-dict pre-hook (``fairscale.runtime.state_hooks`` does not count it as the model's)."""
    entry = _behind(module)
    if entry is not None:
        _refuse(entry, "state_dict()")


def _on_load(module: nn.Module, incompatible: Any) -> None:
    if not incompatible.missing_keys:
        mark_current(module)


def current_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by each of its names (tied weights under each)."""
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(dict(model.named_buffers(remove_duplicate=False)))
    return own
