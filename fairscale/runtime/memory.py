"""Measure the activation bytes a forward pass keeps alive for backward.

Usage::

    with SavedActivationMeter(model.parameters()) as meter:
        loss = gm(*batch)
    print(meter.bytes(exclude=[loss]))     # activations held for backward, parameters excluded

Three kinds of tensors are held for backward, and the meter sees all of them:

* tensors autograd saves (``torch.autograd.graph.saved_tensors_hooks``);
* the inputs recompute regions keep alive (non-reentrant checkpointing holds them by reference,
  so the hooks never see them; ``passes.ops.recompute_ops`` tells the meter);
* storages created during the forward that are still alive after it, such as the matmul outputs
  selective recompute caches outside the hooks (tracked with a dispatch mode and weak references).

Each storage counts once (``x`` saved by three projections counts once); parameters are excluded.
"""

from __future__ import annotations

import gc
from typing import Any, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from passes.ops import recompute_ops

__all__ = ["SavedActivationMeter"]


class SavedActivationMeter(TorchDispatchMode):
    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._exclude = {p.untyped_storage().data_ptr() for p in params}
        self._held: dict[int, int] = {}
        self._created: dict[int, tuple[StorageWeakRef, int]] = {}
        self._hooks: Any = None

    def bytes(self, *, exclude: Iterable[torch.Tensor] = ()) -> int:
        """Activation bytes held for backward now, not counting the storages of ``exclude``
        (e.g. the loss the caller still holds)."""
        gc.collect()
        skip = self._exclude | {t.untyped_storage().data_ptr() for t in exclude}
        alive = {p: n for p, (ref, n) in self._created.items() if not ref.expired()}
        return sum(n for p, n in {**alive, **self._held}.items() if p not in skip)

    def _keep(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr():
                self._held[storage.data_ptr()] = storage.nbytes()
        return t

    def _retained(self, args: tuple[Any, ...]) -> None:
        for a in args:
            self._keep(a)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
                s = t.untyped_storage()
                self._created[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        return out

    def __enter__(self) -> SavedActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._keep, lambda t: t)
        self._hooks.__enter__()
        recompute_ops.RETAIN_LISTENERS.append(self._retained)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        recompute_ops.RETAIN_LISTENERS.remove(self._retained)
        self._hooks.__exit__(*exc)
