"""The run-time op the recompute pass inserts: a region run under non-reentrant checkpointing.

``passes.insert_recompute`` fuses a layer's activation nodes into a submodule and calls it through
:func:`recompute_call`; the rank graph calls it at run time, so it lives with the other run-time ops.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from passes.ops.groups import AxisGroups, current

__all__ = ["recompute_call", "RETAIN_LISTENERS", "RECOMPUTE_LISTENERS"]

_SAVE_IN_SELECTIVE = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_IN_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


RETAIN_LISTENERS: list[Callable[[tuple[Any, ...]], None]] = []
"""Callbacks told the arguments each recompute region keeps alive until backward, and under selective
recompute the matmul and attention outputs its forward caches (for memory meters: non-reentrant
checkpointing holds both by reference, so saved_tensors_hooks never see them)."""


RECOMPUTE_LISTENERS: list[Callable[[list[tuple[StorageWeakRef, int]]], None]] = []
"""Callbacks told, when a region's recompute in backward ends, the storages it created that are
still alive, as (weak reference, bytes): what checkpointing holds for the region's backward. (Its
recompute saves through checkpointing's own saved-tensor hooks, which no outer hook sees.) While
this list is empty, recompute runs without the watch."""


class _RecomputeWatch(TorchDispatchMode):
    """Notes every new storage an op creates during a recompute (not views or in-place results of
    its inputs); on exit tells :data:`RECOMPUTE_LISTENERS` the ones still alive (the region's
    outputs and temporaries are gone by then, what backward will read is held by checkpointing)."""

    def __init__(self) -> None:
        super().__init__()
        self.created: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # views and in-place results share an input's storage: only new storages are the recompute's
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                s = t.untyped_storage()
                if s._cdata not in inputs and s._cdata not in self.created:
                    self.created[s._cdata] = (StorageWeakRef(s), s.nbytes())
        return out

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        alive = [v for v in self.created.values() if not v[0].expired()]
        for listener in RECOMPUTE_LISTENERS:
            listener(alive)


class _CacheWatch(TorchDispatchMode):
    """Tells :data:`RETAIN_LISTENERS` the outputs of the ops selective recompute caches in forward."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _SAVE_IN_SELECTIVE:
            held = tuple(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            for listener in RETAIN_LISTENERS:
                listener(held)
        return out


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


def _contexts(kind: str, table: AxisGroups) -> tuple[Any, Any]:
    # the recompute runs inside backward, which the plain loop calls outside the module: the
    # region's collectives (tp, sp, fsdp) must run over the groups its forward ran over
    if kind != "selective":
        watch = _RecomputeWatch() if RECOMPUTE_LISTENERS else contextlib.nullcontext()
        return contextlib.nullcontext(), _both(table.active(), watch)
    fwd, rec = create_selective_checkpoint_contexts(_selective_policy)
    return (_both(fwd, _CacheWatch()) if RETAIN_LISTENERS else fwd,
            _both(table.active(), _both(rec, _RecomputeWatch()) if RECOMPUTE_LISTENERS else rec))


def recompute_call(fn: Callable[..., Any], kind: str, *args: Any) -> Any:
    """Run ``fn(*args)`` under non-reentrant checkpointing of the given kind."""
    for listener in RETAIN_LISTENERS:
        listener(args)
    if kind not in ("full", "selective"):
        raise ValueError(f"recompute kind must be 'full' or 'selective', got {kind!r}")
    table = current()
    return checkpoint(fn, *args, use_reentrant=False, context_fn=lambda: _contexts(kind, table))
