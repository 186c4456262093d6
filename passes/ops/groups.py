"""Which process group each axis name means: tables owned by meshes, one active at a time.

Rank graphs name groups by axis (``tp_all_reduce(x, 'tp')``). What ``'tp'`` means is not a fact
of the process but of the model running: two ``ParallelModule`` objects in one process (a model
and its teacher, a trained model and one being evaluated under another plan) each have their own
``tp``. So each mesh owns an :class:`AxisGroups` table, and the module makes it the *active* one
while it runs (``with table.active():``, a ``contextvars`` variable, so threads and nested modules
do not see each other's). Autograd functions remember the table that was active in their forward
and run their backward under it (:func:`group_function`), so ``loss.backward()`` outside any
module still reduces over the forward's groups.

Outside every module the :data:`PROCESS` table applies: the process-wide groups that FairScale's
classic modules bind (``initialize_model_parallel``, ``FullyShardedDataParallel``, ``OSS``), which
are process-wide in FairScale too. An axis bound nowhere is a group of size 1 (a rank graph run in
one process), except when a live mesh binds it: then the call ran outside the module that owns the
group, and it fails rather than silently skip a collective.

Each table also counts the bytes its collectives moved (``table.counter``); the process-wide
``passes.ops.comm.COUNTER`` counts every collective of the process.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from typing import Any, Callable, Iterator

import torch

__all__ = ["AxisGroups", "PROCESS", "current", "group_function"]


class AxisGroups:
    """Axis name -> process group (``None``: size 1), holding weak references only: torch's own
    registry keeps a group alive until ``dist.destroy_process_group``, and a strong reference here
    would keep its gloo worker threads running into interpreter finalization, where they can abort
    the process. ``counter`` is a ``passes.ops.comm.CommCounter`` (set by ``comm``)."""

    def __init__(self, name: str, *, owned: bool = True) -> None:
        self.name = name
        self._refs: dict[str, Any] = {}
        self.counter: Any = None
        if owned:
            _OWNED.add(self)

    def bind(self, axis: str, group: Any) -> None:
        self._refs[axis] = None if group is None else weakref.ref(group)

    def clear(self) -> None:
        self._refs.clear()

    def binds(self, axis: str) -> bool:
        return axis in self._refs

    def get(self, axis: str) -> Any:
        ref = self._refs.get(axis)
        if ref is None:
            return None
        group = ref()
        if group is None:
            raise RuntimeError(f"the process group bound to axis {axis!r} of {self.name} was destroyed "
                               "(dist.destroy_process_group); bind a live group with passes.ops.comm.set_group")
        return group

    def has_live_group(self, axis: str) -> bool:
        ref = self._refs.get(axis)
        return ref is not None and ref() is not None

    @contextlib.contextmanager
    def active(self) -> Iterator[AxisGroups]:
        """Run the block with this table's groups (nests; restores the previous table on exit)."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def __repr__(self) -> str:
        return f"AxisGroups({self.name!r}, axes={sorted(self._refs)})"


_OWNED: weakref.WeakSet[AxisGroups] = weakref.WeakSet()
"""Tables of live meshes (their owner holds them; a dead module's table leaves the set)."""

PROCESS = AxisGroups("the process-wide groups", owned=False)
"""What applies outside every module: the groups classic FairScale modules bind."""

_ACTIVE: contextvars.ContextVar[AxisGroups | None] = contextvars.ContextVar("fairscale_axis_groups", default=None)


def current() -> AxisGroups:
    """The active table: the running module's, else :data:`PROCESS`."""
    return _ACTIVE.get() or PROCESS


def resolve(axis: str) -> Any:
    """The group ``axis`` means here (``None``: size 1). See the module docstring for the order."""
    table = _ACTIVE.get()
    if table is not None and table.binds(axis):
        return table.get(axis)
    if PROCESS.binds(axis):
        return PROCESS.get(axis)
    if table is None or table is PROCESS:
        owners = [t.name for t in list(_OWNED) if t.has_live_group(axis)]
        if owners:
            raise RuntimeError(
                f"a collective over axis {axis!r} ran outside the module whose mesh owns that group ({owners[0]}): "
                "call it through the ParallelModule (pm.train_step, pm(batch), pm.optimizer, pm.state_dict, ...) "
                "or inside `with pm.mesh.groups.active():`")
    return None


def group_function(cls: type) -> type:
    """Class decorator for a ``torch.autograd.Function`` whose forward and backward use axis names:
    the backward runs under the table that was active in the forward (``loss.backward()`` is called
    outside the module, and on GPUs autograd runs it on another thread)."""
    forward: Callable[..., Any] = cls.forward  # type: ignore[attr-defined]
    backward: Callable[..., Any] = cls.backward  # type: ignore[attr-defined]

    @functools.wraps(forward)
    def remembering_forward(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        ctx.fs_groups = current()
        return forward(ctx, *args, **kwargs)

    @functools.wraps(backward)
    def backward_under_forward_groups(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():  # create_graph=True: the collectives' backward is not differentiable
            raise RuntimeError(
                f"a gradient of a gradient (create_graph=True: torch.autograd.grad(loss, params, create_graph=True) "
                f"for a gradient penalty, or a Hessian-vector product) reached {cls.__name__}, a collective of a "
                "ParallelModule's rank graph, whose backward is not differentiable: the second-order term would be "
                "lost, silently. Gradients of gradients are not supported under plans with collectives (dp, tp or "
                "ep > 1): drop the term, or train the model with a plan on one device")
        with ctx.fs_groups.active():
            return backward(ctx, *grads)

    cls.forward = staticmethod(remembering_forward)  # type: ignore[attr-defined]
    cls.backward = staticmethod(backward_under_forward_groups)  # type: ignore[attr-defined]
    cls.remembers_groups = True  # type: ignore[attr-defined]  # what tests/passes/test_group_functions.py checks
    return cls
