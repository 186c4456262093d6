"""One worker thread per device, computing the pipeline's tasks in the order they are queued.

    with spawn_workers(devices) as (in_queues, out_queues):
        in_queues[j].put(Task(stream, compute=f, finalize=g))
        ok, payload = out_queues[j].get()     # (True, (task, batch)) or (False, exc_info)

Devices that are the same device share a worker (all CPU devices are one); the threads inherit
the caller's grad mode and are joined when the block exits, even on an exception.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from queue import Queue
from types import TracebackType
from typing import Any, Callable, Iterator, Optional

import torch

from fairscale.nn.pipe.microbatch import Batch
from fairscale.nn.pipe.stream import AbstractStream, use_device, use_stream

__all__ = ["Task", "spawn_workers", "worker", "create_workers", "join_workers"]

ExcInfo = tuple[type[BaseException], BaseException, TracebackType]
InQueue = "Queue[Optional[Task]]"
OutQueue = "Queue[tuple[bool, Any]]"


class Task:
    """``compute`` (runs in the worker thread on ``stream``, returns a Batch) and ``finalize(batch)``
    (runs in the thread that collects the result)."""

    def __init__(self, stream: AbstractStream, *, compute: Callable[[], Batch],
                 finalize: Optional[Callable[[Batch], None]]) -> None:
        self.stream = stream
        self._compute = compute
        self._finalize = finalize
        self._grad_enabled = torch.is_grad_enabled()

    def compute(self) -> Batch:
        with use_stream(self.stream), torch.set_grad_enabled(self._grad_enabled):
            return self._compute()

    def finalize(self, batch: Batch) -> None:
        if self._finalize is None:
            return
        with use_stream(self.stream), torch.set_grad_enabled(self._grad_enabled):
            self._finalize(batch)


def worker(in_queue: "Queue[Optional[Task]]", out_queue: "Queue[tuple[bool, Any]]", device: Any,
           grad_mode: bool) -> None:
    """Run tasks from ``in_queue`` until a ``None``; results go to ``out_queue``, then ``(False, None)``."""
    torch.set_grad_enabled(grad_mode)
    with use_device(device) if isinstance(device, torch.device) else contextlib.nullcontext():
        while True:
            task = in_queue.get()
            if task is None:
                break
            try:
                batch = task.compute()
            except Exception:
                out_queue.put((False, sys.exc_info()))
                continue
            out_queue.put((True, (task, batch)))
    out_queue.put((False, None))


def _device_key(device: Any) -> Any:
    if isinstance(device, torch.device):
        return ("cpu",) if device.type == "cpu" else (device.type, device.index)
    return id(device)  # test doubles: every object its own device


def create_workers(devices: list[Any]) -> tuple[list["Queue[Optional[Task]]"], list["Queue[tuple[bool, Any]]"]]:
    """Start a worker per distinct device; returns each device's (shared) input and output queue."""
    by_key: dict[Any, tuple[Queue, Queue]] = {}
    in_queues, out_queues = [], []
    for device in devices:
        key = _device_key(device)
        if key not in by_key:
            queues: tuple[Queue, Queue] = (Queue(), Queue())
            by_key[key] = queues
            t = threading.Thread(target=worker, args=(*queues, device, torch.is_grad_enabled()), daemon=True)
            t.start()
        in_queues.append(by_key[key][0])
        out_queues.append(by_key[key][1])
    return in_queues, out_queues


def join_workers(in_queues: list["Queue[Optional[Task]]"], out_queues: list["Queue[tuple[bool, Any]]"]) -> None:
    """Stop each distinct worker after the tasks already queued, and wait for it."""
    for q in {id(q): q for q in in_queues}.values():
        q.put(None)
    for q in {id(q): q for q in out_queues}.values():
        while True:
            ok, payload = q.get()
            if not ok and payload is None:
                break


@contextlib.contextmanager
def spawn_workers(devices: list[Any]) -> Iterator[tuple[list["Queue[Optional[Task]]"], list["Queue[tuple[bool, Any]]"]]]:
    in_queues, out_queues = create_workers(devices)
    try:
        yield in_queues, out_queues
    finally:
        join_workers(in_queues, out_queues)
