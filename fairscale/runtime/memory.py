"""Measure the activation bytes a forward pass keeps alive for backward.

Usage::

    with SavedActivationMeter(model.parameters()) as meter:
        loss = gm(*batch)
    print(meter.bytes)          # activations retained for backward, parameters excluded

It counts every tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``) and the
inputs that recompute regions keep alive (non-reentrant checkpointing holds them by reference, so
the hooks never see them). Each storage counts once, so ``x`` saved by three projections is
counted once, and parameters are excluded.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from passes import insert_recompute

__all__ = ["SavedActivationMeter"]


class SavedActivationMeter:
    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {p.untyped_storage().data_ptr() for p in params}
        self._seen: dict[int, int] = {}
        self._hooks: Any = None

    @property
    def bytes(self) -> int:
        """Activation bytes retained for backward so far."""
        return sum(self._seen.values())

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self._exclude:
            self._seen[ptr] = storage.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._count(t)
        return t

    def _retained(self, args: tuple[Any, ...]) -> None:
        for a in args:
            if isinstance(a, torch.Tensor):
                self._count(a)

    def __enter__(self) -> SavedActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        insert_recompute.RETAIN_LISTENERS.append(self._retained)
        return self

    def __exit__(self, *exc: Any) -> None:
        insert_recompute.RETAIN_LISTENERS.remove(self._retained)
        self._hooks.__exit__(*exc)
