"""How data-parallel gradients reach ``.grad``: no-sync accumulation, asynchronous reductions
delivered at the end of backward, and the copies between the compute device and an offloaded store.

The ops in :mod:`passes.ops.dp_ops` (DDP/ZeRO buckets, FSDP units) launch their gradient
collectives in backward without waiting and hand each one to :func:`enqueue`. A callback queued on
the autograd engine (``Variable._execution_engine.queue_callback``, what PyTorch DDP uses) runs when
that backward call finishes: it waits for the call's reductions in launch order and accumulates
their results into ``.grad`` with AccumulateGrad's rule (assign when ``None``, else add), so
``zero_grad(set_to_none=True)`` stays safe and every caller of ``backward`` sees final gradients when
it returns. :func:`async_targets` says when that is allowed (autograd would accumulate into every
leaf); otherwise an op reduces synchronously and returns its gradients through autograd.

A reduction is any object with ``finish() -> tuple of gradients`` and ``targets`` (the leaves, in
the same order, None for an input without one).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

__all__ = ["no_sync", "sync_enabled", "to_store", "to_compute", "flat_grads", "pending_reductions", "wait_reductions",
           "async_targets", "enqueue", "finish_items", "finish_where", "drop_stale", "drop_stale_outside_backward"]

_SYNC = [True]


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Defer gradient reduction: backward passes inside accumulate locally; the next backward
    outside reduces the accumulated total once. Nestable; applies to every data-parallel graph of
    this process (all pipeline stages of a rank accumulate the same microbatches)."""
    prev = _SYNC[0]
    _SYNC[0] = False
    try:
        yield
    finally:
        _SYNC[0] = prev


def sync_enabled() -> bool:
    return _SYNC[0]


def to_store(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (on the compute device) as a new tensor on ``like``'s device and dtype: a gradient for
    a master shard. A copy into the host store lands in pinned memory when the store is pinned."""
    if t.device == like.device:
        return t.to(like.dtype, copy=True)
    out = torch.empty(t.shape, dtype=like.dtype, device=like.device, pin_memory=like.is_pinned())
    out.copy_(t)  # blocking: whatever reads .grad next (clipping, the CPU optimizer) sees it complete
    return out


def to_compute(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A master shard ``t`` on the compute device in ``dtype``: asynchronous from pinned memory (the
    copy is ordered before the collective that reads it on the same stream)."""
    return t.detach().to(device=device, dtype=dtype, non_blocking=t.is_pinned())


def flat_grads(grads: tuple[torch.Tensor | None, ...], shapes: list[torch.Size], padded: int,
                dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Concatenate member gradients (None = zero, unused member) into one padded flat tensor."""
    flat = torch.empty(padded, dtype=dtype, device=device)  # one write per element, not zero-fill + copy
    start = 0
    for g, shape in zip(grads, shapes):
        n = shape.numel()
        if g is not None:
            flat[start:start + n].copy_(g.reshape(-1))
        else:
            flat[start:start + n].zero_()
        start += n
    flat[start:].zero_()
    return flat


_INFLIGHT: list[tuple[int, Any]] = []
"""(autograd graph task id, reduction) of every bucket or unit reduction launched and not yet finished."""
_CALLBACK_TASKS: set[int] = set()
"""Graph tasks that already have a finishing callback queued."""


def pending_reductions() -> int:
    """How many asynchronous bucket and unit reductions are in flight (0 outside backward)."""
    return len(_INFLIGHT)


@torch.no_grad()
def _accumulate(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    """AccumulateGrad's rule: take the gradient when ``.grad`` is None, else add into it."""
    if leaf.grad is None:
        leaf.grad = grad
    else:
        leaf.grad += grad


def finish_items(items: list[tuple[int, Any]], *, apply: bool = True) -> None:
    for _, red in items:
        grads = red.finish()
        if apply:
            for leaf, g in zip(red.targets, grads):
                if leaf is not None and g is not None:
                    _accumulate(leaf, g)


def _finish_task(task: int) -> None:
    mine = [item for item in _INFLIGHT if item[0] == task]
    _INFLIGHT[:] = [item for item in _INFLIGHT if item[0] != task]
    _CALLBACK_TASKS.discard(task)
    finish_items(mine)


def wait_reductions() -> None:
    """Finish every in-flight bucket reduction now (the end-of-backward callback does this on its
    own; call it only to read gradients from inside a backward, e.g. in a hook)."""
    items = list(_INFLIGHT)
    _INFLIGHT.clear()
    _CALLBACK_TASKS.clear()
    finish_items(items)


def drop_stale() -> None:
    """Reductions still in flight outside any backward belong to a backward that raised before its
    callback ran: complete the collectives (every rank issued them) and drop their partial results."""
    items = list(_INFLIGHT)
    _INFLIGHT.clear()
    _CALLBACK_TASKS.clear()
    finish_items(items, apply=False)


def async_targets(ctx: Any) -> tuple[torch.Tensor | None, ...] | None:
    """The leaves whose ``.grad`` an asynchronous reduction may write: ``ctx.tensor_inputs``, None
    for inputs that take no gradient. None when autograd would not accumulate into every one of them
    (``autograd.grad``, a subset ``inputs=``, non-leaves, hooks, ``create_graph``): reduce synchronously."""
    if torch.is_grad_enabled():  # create_graph=True: gradients must stay differentiable graph values
        return None
    targets: list[torch.Tensor | None] = []
    for t, (node, _) in zip(ctx.tensor_inputs, ctx.next_functions):
        if not t.requires_grad:
            targets.append(None)
            continue
        hooked = t._backward_hooks or getattr(t, "_post_accumulate_grad_hooks", None)
        if node is None or t.grad_fn is not None or hooked:  # hooks expect AccumulateGrad to run them
            return None
        try:
            if not torch._C._will_engine_execute_node(node):
                return None
        except RuntimeError:  # autograd.grad(): the engine captures gradients instead of accumulating
            return None
        targets.append(t)
    return tuple(targets)


def enqueue(red: Any) -> None:
    """Track an asynchronous reduction of the running backward; its results reach ``.grad`` in the
    callback queued at the end of that backward (one callback per backward call)."""
    task = torch._C._current_graph_task_id()
    _INFLIGHT.append((task, red))
    if task not in _CALLBACK_TASKS:
        _CALLBACK_TASKS.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _finish_task(task))


def drop_stale_outside_backward() -> None:
    """Called at a forward: reductions still in flight outside any backward belong to a backward
    that raised before its callback ran; complete and drop them (see :func:`drop_stale`)."""
    if _INFLIGHT and torch._C._current_graph_task_id() == -1:
        drop_stale()


def finish_where(task: int, keep: Callable[[Any], bool]) -> None:
    """Finish now, in launch order, the running backward ``task``'s reductions for which ``keep`` holds."""
    mine = [item for item in _INFLIGHT if item[0] == task and keep(item[1])]
    if mine:
        _INFLIGHT[:] = [item for item in _INFLIGHT if item not in mine]
        finish_items(mine)
