"""The optimizer a script built over its model and gave to ``fairscale.parallelize``, kept from use.

``parallelize`` reads the instance into groups (:mod:`fairscale.runtime.optim_groups`) and each rank
steps an optimizer of its own over its slices and shards: ``pm.optimizer``. The instance holds the
model's own tensors, which get no gradients once parallelized, so a loop that went on with it::

    pm = fairscale.parallelize(model, example_inputs=batch, optimizer=opt)
    sched = get_linear_schedule_with_warmup(opt, ...)     # or built before parallelize
    ...
    opt.step(); sched.step(); opt.zero_grad()

trained nothing (every loss the same), or, stepping ``pm.optimizer`` with the scheduler still on
the instance, trained at the starting learning rate, without a word. Now:

* a learning-rate scheduler built on the instance before ``parallelize`` is refused there, before
  anything runs (:func:`refuse_schedulers`): it had been refused only at the first step after it
  moved the rate (a ``StepLR(step_size=100)`` at step 100, mid-run);
* the instance's ``step()`` and ``zero_grad()`` raise, saying to use ``pm.optimizer``
  (:func:`disown`);
* ``pm.optimizer.step()`` raises, before it steps, when an option of the instance's groups (a
  scheduler's ``lr``, a hand-set weight decay) changed since ``parallelize`` read it, naming the
  group, the option and both values (:func:`watch`);
* an optimizer built over the model's tensors after ``parallelize`` (accelerate's order: the model
  prepared first, then ``AdamW(model.parameters())``) raises at a ``step()`` that would do nothing,
  none of them holding a gradient, every loss the same (:func:`guard_new_optimizers`); a gradient
  left from a backward run before ``parallelize`` does not count (:func:`note_gradients`): its first
  step had applied it to the unused model and the refusal came only at the second.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["UserOptimizerError", "disown", "watch", "guard_new_optimizers", "note_gradients", "refuse_schedulers", "schedulers_of"]

_USE = ("set options on pm.optimizer.param_groups, attach learning-rate schedulers to pm.optimizer, and "
        "call pm.optimizer.step() / pm.optimizer.zero_grad() (or pm.train_step(batch))")


class UserOptimizerError(RuntimeError):
    """The optimizer given to ``fairscale.parallelize`` was used as if it trained the model."""


def disown(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer``'s ``step`` and ``zero_grad`` raise."""
    name = type(optimizer).__name__
    why = (f"this {name} was given to fairscale.parallelize, which trains the model's slices and shards with "
           f"pm.optimizer; this {name}'s tensors are the model's own, which get no gradients once parallelized, "
           f"so %s would do nothing: {_USE}")

    def refuse_step(*_: Any) -> None:
        raise UserOptimizerError(why % "its step()")

    def refuse_zero_grad(*_: Any, **__: Any) -> None:
        raise UserOptimizerError(why % "its zero_grad()")

    if not getattr(optimizer, "_fairscale_disowned", False):
        optimizer.register_step_pre_hook(refuse_step)
        optimizer.zero_grad = refuse_zero_grad  # type: ignore[method-assign]
        optimizer._fairscale_disowned = True  # type: ignore[attr-defined]


def refuse_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """Raise if a learning-rate scheduler (any ``torch.optim.lr_scheduler`` class, or one of their
    subclasses) holds ``optimizer``, the instance given to ``parallelize``."""
    held = schedulers_of(optimizer)
    if held:
        name, kind = type(optimizer).__name__, type(held[0]).__name__
        raise UserOptimizerError(
            f"optimizer: a learning-rate scheduler ({kind}) was built on this {name} before fairscale.parallelize, "
            f"which trains with pm.optimizer, built from the {name}'s groups and options: the scheduler would set the "
            f"rate of an optimizer that trains nothing. Build the scheduler after the call, on pm.optimizer: "
            f"pm = fairscale.parallelize(model, ..., optimizer={name.lower()}); scheduler = {kind}(pm.optimizer, ...)")


def schedulers_of(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The learning-rate schedulers alive that hold ``optimizer`` (those a script dropped are collected
    first, where any is found: a full collection in a large process is slow)."""
    held = _holding(optimizer)
    if held:
        gc.collect()
        held = _holding(optimizer)
    return held


def _holding(optimizer: torch.optim.Optimizer) -> list[Any]:
    refs = gc.get_referrers(optimizer)
    held = [o for o in refs if isinstance(o, _SCHEDULERS)]
    held += [o for d in refs if isinstance(d, dict) for o in gc.get_referrers(d)
             if isinstance(o, _SCHEDULERS) and getattr(o, "__dict__", None) is d]
    return list({id(o): o for o in held if o.optimizer is optimizer}.values())


_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def watch(stepped: torch.optim.Optimizer, source: Callable[[], torch.optim.Optimizer | None],
          options: tuple[dict[str, Any], ...]) -> None:
    """Before each step of ``stepped`` (``pm.optimizer``), raise if the groups of the instance
    ``source`` refers to no longer have ``options`` (what ``parallelize`` read)."""
    options = tuple({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in o.items()} for o in options)

    def check(*_: Any) -> None:
        opt = source()
        if opt is None:
            return
        for g, (group, was) in enumerate(zip(opt.param_groups, options)):
            now = {k: v for k, v in group.items() if k != "params"}
            for key in sorted(set(now) | set(was)):
                if key not in was or key not in now or not _same(now[key], was[key]):
                    change = (f"gained {key!r} = {now[key]!r} (a learning-rate scheduler attached to it?)"
                              if key not in was else f"lost {key!r}" if key not in now else
                              f"has {key!r} = {now[key]!r}, where fairscale.parallelize read {was[key]!r}")
                    raise UserOptimizerError(
                        f"param_groups[{g}] of the {type(opt).__name__} given to fairscale.parallelize {change}: that "
                        f"optimizer does not train the model (pm.optimizer does, from the options it had then), so "
                        f"the change would be lost; {_USE}")

    stepped.register_step_pre_hook(check)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an option whose == does not give a bool
        return a is b


_LIVE: "weakref.WeakKeyDictionary[Any, frozenset[int]]" = weakref.WeakKeyDictionary()
_HOOK: list[Any] = []
_BEFORE: "weakref.WeakKeyDictionary[Any, dict[int, weakref.ref[torch.Tensor]]]" = weakref.WeakKeyDictionary()
"""pm -> the gradients its model's parameters held when it was built (a backward run before the
call): they are not the script training the model itself."""


def note_gradients(pm: Any, model: torch.nn.Module | None) -> None:
    """Remember the gradients ``model``'s parameters hold as ``pm`` is built (:func:`guard_new_optimizers`)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None] if model is not None else []
    _BEFORE[pm] = {id(g): weakref.ref(g) for g in grads}


def _fresh(pm: Any, grad: torch.Tensor | None) -> bool:
    """Whether ``grad`` came after ``pm`` was built (not one the model held before)."""
    if grad is None:
        return False
    before = _BEFORE.get(pm, {}).get(id(grad))
    return before is None or before() is not grad


def guard_new_optimizers(pm: Any) -> None:
    """Refuse the step of any optimizer over the tensors of ``pm``'s model (a global step pre-hook)."""
    _LIVE[pm] = frozenset()  # the model's tensors are read at the first step (pm is still being built)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_models_tensors))


def _refuse_models_tensors(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    if getattr(optimizer, "_fairscale_disowned", False):
        return  # the instance given to parallelize: its own hook says so
    for pm, ids in list(_LIVE.items()):
        model = None if pm.retired else getattr(pm, "_user_model", lambda: None)()
        if model is None:
            continue
        if not ids:
            ids = _LIVE[pm] = frozenset(id(p) for p in model.parameters())
        held = [p for g in optimizer.param_groups for p in g["params"] if id(p) in ids]
        if not held or any(_fresh(pm, p.grad) for p in held):
            continue  # a new gradient: the script trains the model itself, in one process (after pm.gather_into)
        names = [n for n, p in model.named_parameters() if any(p is q for q in held)]
        name = type(optimizer).__name__
        raise UserOptimizerError(
            f"this {name} holds {len(held)} parameter(s) of the {type(model).__name__} passed to "
            f"fairscale.parallelize (e.g. {', '.join(names[:3])}), which get no gradients once parallelized "
            f"(its ranks train slices and shards), so its step() would train nothing: build the {name} over the "
            f"model before the call and pass it, fairscale.parallelize(model, ..., optimizer={name.lower()}), then "
            f"{_USE}")
