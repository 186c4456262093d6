"""The single-process pipeline: micro-batches through partitions in clock cycles, on worker threads.

Micro-batch ``i`` runs on partition ``j`` at clock ``i + j`` (GPipe, Huang et al. 2019; torchgpipe,
Kim et al. 2020)::

    clock      0    1    2    3    4          (3 micro-batches, 3 partitions)
    part 0    F0   F1   F2
    part 1         F0   F1   F2
    part 2              F0   F1   F2

Each clock: *fence* (in the calling thread) links the cells into one autograd graph: micro-batch
``i`` is copied from partition ``j-1``'s device to ``j``'s, skip tensors come through their
portals, and a phony edge makes micro-batch ``i``'s backward on partition ``j`` run before
``i-1``'s; then *compute* queues the cells to the partitions' workers (checkpointed ones as
:class:`Checkpointing`, whose recomputation is scheduled during *finalize*, back in the calling
thread), collects their outputs in order, and stops at the first exception.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from fairscale.nn.pipe.checkpoint import Checkpointing
from fairscale.nn.pipe.copy import Copy, Wait
from fairscale.nn.pipe.dependency import fork, join
from fairscale.nn.pipe.microbatch import Batch, TensorOrTensors
from fairscale.nn.pipe.skip.layout import SkipLayout
from fairscale.nn.pipe.skip.tracker import SkipTrackerThroughPotals, use_skip_tracker
from fairscale.nn.pipe.stream import AbstractStream, current_stream, use_device
from fairscale.nn.pipe.worker import Task, spawn_workers

__all__ = ["Pipeline", "clock_cycles", "depend", "copy", "wait"]


def clock_cycles(m: int, n: int) -> Iterable[list[tuple[int, int]]]:
    """For ``m`` micro-batches and ``n`` partitions, the ``(micro-batch, partition)`` cells of each
    clock, later micro-batches first: ``clock_cycles(3, 3)`` yields ``[(0, 0)]``,
    ``[(1, 0), (0, 1)]``, ``[(2, 0), (1, 1), (0, 2)]``, ``[(2, 1), (1, 2)]``, ``[(2, 2)]``."""
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]


def depend(fork_from: Batch, join_to: Batch) -> None:
    """In backward, ``join_to``'s gradient is computed before ``fork_from``'s."""
    fork_from[0], phony = fork(fork_from[0])
    join_to[0] = join(join_to[0], phony)


def _detach_non_float(batch: Batch) -> None:
    batch[:] = tuple(x if x.is_floating_point() else x.detach() for x in batch)


def copy(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    batch[:] = Copy.apply(prev_stream, next_stream, *batch)
    _detach_non_float(batch)


def wait(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    batch[:] = Wait.apply(prev_stream, next_stream, *batch)
    _detach_non_float(batch)


class Pipeline:
    """Runs micro-batches through ``partitions`` (one device each); the first ``checkpoint_stop``
    micro-batches are checkpointed (in training mode with grad enabled)."""

    def __init__(self, partitions: list[nn.Sequential], devices: list[torch.device],
                 copy_streams: list[list[AbstractStream]], skip_layout: SkipLayout, checkpoint_stop: int) -> None:
        self.partitions = partitions
        self.devices = devices
        self.copy_streams = copy_streams
        self.skip_layout = skip_layout
        self.checkpoint_stop = checkpoint_stop

    def run(self, batches: list[Batch]) -> None:
        """Run ``batches`` through the pipeline, replacing each by its output in place."""
        m, n = len(batches), len(self.partitions)
        trackers = [SkipTrackerThroughPotals(self.skip_layout, i) for i in range(m)]
        with spawn_workers(self.devices) as (in_queues, out_queues):
            for schedule in clock_cycles(m, n):
                self.fence(batches, schedule, trackers)
                self.compute(batches, schedule, trackers, in_queues, out_queues)

    def fence(self, batches: list[Batch], schedule: list[tuple[int, int]],
              trackers: list[SkipTrackerThroughPotals]) -> None:
        """Copy each cell's inputs (and crossing skips) onto its partition's device, and order the
        micro-batches' backward passes."""
        for i, j in schedule:
            if i != 0 and j != 0:
                depend(batches[i - 1], batches[i])
            next_stream = self.copy_streams[j][i]
            for prev_j, ns, name in self.skip_layout.copy_policy(j):
                trackers[i].copy(batches[i], self.copy_streams[prev_j][i], next_stream, ns, name)
            if j != 0:
                copy(batches[i], self.copy_streams[j - 1][i], next_stream)

    def compute(self, batches: list[Batch], schedule: list[tuple[int, int]],
                trackers: list[SkipTrackerThroughPotals], in_queues: list[Any], out_queues: list[Any]) -> None:
        """Run one clock's cells on the workers; raise the first exception after the clock."""
        n = len(self.partitions)
        streams = [current_stream(d) for d in self.devices]
        checkpoint_stop = self.checkpoint_stop
        if not self.partitions[0].training or not torch.is_grad_enabled():
            checkpoint_stop = 0  # nothing to recompute without a backward pass
        for i, j in schedule:
            batch = batches[i]
            if j != 0:
                wait(batch, self.copy_streams[j][i], streams[j])
            function = _Cell(self.partitions[j], trackers[i])
            if i < checkpoint_stop:
                chk = Checkpointing(function, batch)
                task = Task(streams[j], compute=chk.checkpoint, finalize=chk.recompute)
            else:
                task = Task(streams[j], compute=_Call(function, batch), finalize=None)
            in_queues[j].put(task)
        exc_info = None
        for i, j in schedule:
            ok, payload = out_queues[j].get()
            if exc_info is not None:
                continue  # drain this clock's results; the first exception wins
            if not ok:
                exc_info = payload
                continue
            task, batch = payload
            if j != n - 1:  # the copy stream waits for the output before copying it on
                wait(batch, streams[j], self.copy_streams[j][i])
            with use_device(self.devices[j]):
                task.finalize(batch)
            batches[i] = batch
        if exc_info is not None:
            raise exc_info[1].with_traceback(exc_info[2])


class _Cell:
    """A partition run with a micro-batch's skip tracker installed (in the worker thread)."""

    def __init__(self, partition: nn.Sequential, tracker: SkipTrackerThroughPotals) -> None:
        self.partition = partition
        self.tracker = tracker

    def __call__(self, input: TensorOrTensors) -> TensorOrTensors:  # noqa: A002
        with use_skip_tracker(self.tracker):
            return self.partition(input)


class _Call:
    """A task's compute without checkpointing."""

    def __init__(self, function: _Cell, batch: Batch) -> None:
        self.function = function
        self.batch = batch

    def __call__(self) -> Batch:
        return self.batch.call(self.function)
