"""Where stashed skip tensors wait for their pop.

Outside a Pipe, the thread's default :class:`SkipTracker` holds them (a Sequential of skippable
layers runs on its own). Inside a Pipe, each micro-batch has a :class:`SkipTrackerThroughPotals`:
skips within one partition are held as tensors, skips that cross partitions travel through a
:class:`~fairscale.nn.pipe.skip.portal.Portal` whose phonies join the micro-batch's autograd graph.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional

import torch

from fairscale.nn.pipe.checkpoint import is_checkpointing, is_recomputing
from fairscale.nn.pipe.dependency import fork, join
from fairscale.nn.pipe.microbatch import Batch
from fairscale.nn.pipe.skip.portal import Portal
from fairscale.nn.pipe.stream import AbstractStream

__all__ = ["SkipTracker", "SkipTrackerThroughPotals", "current_skip_tracker", "use_skip_tracker"]


class SkipTracker:
    """Stashed tensors by ``(namespace, name)``; a pop takes the tensor out."""

    def __init__(self) -> None:
        self.tensors: dict[tuple[Any, str], Optional[torch.Tensor]] = {}

    def save(self, batch: Batch, ns: Any, name: str, tensor: Optional[torch.Tensor]) -> None:
        self.tensors[(ns, name)] = tensor

    def load(self, batch: Batch, ns: Any, name: str) -> Optional[torch.Tensor]:
        return self.tensors.pop((ns, name))

    def copy(self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream, ns: Any,
             name: str) -> None:
        raise TypeError("copy is not supported for non-portal skip tensors")


class SkipTrackerThroughPotals(SkipTracker):
    """The tracker of micro-batch ``index`` in a Pipe laid out as ``skip_layout``.

    Tensor lives (how many times a crossing skip's tensor is taken out of its portal):
    2 without checkpointing (blue, orange); 3 when the stashing cell is checkpointed (blue, orange,
    and orange again when the popping cell recomputes); the stashing cell's own recomputation puts
    the tensor back for one more blue.
    """

    def __init__(self, skip_layout: Any, index: int = 0) -> None:  # a skip.layout.SkipLayout
        super().__init__()
        self.skip_layout = skip_layout
        self.index = index
        self.portals: dict[tuple[Any, str], Portal] = {}

    def save(self, batch: Batch, ns: Any, name: str, tensor: Optional[torch.Tensor]) -> None:
        if not self.skip_layout.requires_copy(ns, name):
            super().save(batch, ns, name, tensor)
            return
        portal = self.portals.get((ns, name))
        if portal is None:
            portal = Portal(tensor, 3 if is_checkpointing() else 2, self.index)
            self.portals[(ns, name)] = portal
        else:  # the stashing cell recomputes, or stashes again: one more blue
            portal.put_tensor(tensor, 1)
        phony = portal.blue()
        i = batch.find_tensor_idx()
        batch[i] = join(batch[i], phony)

    def load(self, batch: Batch, ns: Any, name: str) -> Optional[torch.Tensor]:
        if not self.skip_layout.requires_copy(ns, name):
            return super().load(batch, ns, name)
        portal = self.portals[(ns, name)]
        i = batch.find_tensor_idx()
        batch[i], phony = fork(batch[i])
        return portal.orange(phony)

    def copy(self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream, ns: Any,
             name: str) -> None:
        """Move the skip's tensor along with ``batch`` from ``prev_stream``'s device to ``next_stream``'s."""
        assert self.skip_layout.requires_copy(ns, name)
        portal = self.portals[(ns, name)]
        i = batch.find_tensor_idx()
        batch[i], phony = fork(batch[i])
        phony = portal.copy(prev_stream, next_stream, phony)
        batch[i] = join(batch[i], phony)


class _Local(threading.local):
    tracker: Optional[SkipTracker] = None


_LOCAL = _Local()


def current_skip_tracker() -> SkipTracker:
    """This thread's tracker (a thread's first call creates its default one)."""
    tracker = _LOCAL.tracker
    if tracker is None:
        tracker = SkipTracker()
        _LOCAL.tracker = tracker
    return tracker


@contextlib.contextmanager
def use_skip_tracker(skip_tracker: SkipTracker) -> Iterator[None]:
    """Make ``skip_tracker`` this thread's tracker in the block."""
    old = _LOCAL.tracker
    _LOCAL.tracker = skip_tracker
    try:
        yield
    finally:
        _LOCAL.tracker = old
