"""This rank's flight record: its last collectives and point-to-point batches, and the one it is
waiting on (in the spirit of NCCL's flight recorder, ``TORCH_NCCL_TRACE_BUFFER_SIZE``).

Every collective of :mod:`passes.ops.comm` and every point-to-point batch of the pipeline posts
an :class:`Entry` (what, on which axis, what tensors, and the runtime's ``context``: step and
schedule action) and waits for it through :meth:`FlightRecorder.wait`, which notes when the host
started and stopped waiting. The runtime's watchdog (``fairscale.runtime.watchdog``) publishes
:meth:`FlightRecorder.state` for the other ranks to read, and turns a failed wait (a timeout, a
dead peer) into an error that says what this rank waited for and which rank it waited on, through
the ``explain`` hook. Asynchronous works are wrapped in :class:`TracedWork`, so a wait anywhere
(data-parallel buckets, FSDP prefetches) is recorded and explained alike.

Recording is a few attribute writes per collective (no tensor is touched), so it is always on.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["Entry", "FlightRecorder", "TracedWork", "RECORDER", "describe_tensor"]


@dataclass
class Entry:
    """One collective or point-to-point batch this rank posted."""

    seq: int
    """Position in this rank's record (1 = first)."""
    op: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``, ``all_to_all``, ``p2p``, or
    ``call``: a method every rank calls together (:meth:`FlightRecorder.call`)."""
    axis: str
    """The comm axis (``pp``, ``dp``, ``tp``, ``ep``, ...)."""
    detail: str
    """What it moves: ``float32[8, 64]``, or a batch's messages and peers."""
    context: str
    """Where the runtime was: ``step 2, F1@0``."""
    posted: float
    """time.time() when posted."""
    waiting: float | None = None
    """When the host started waiting for it (None: not yet)."""
    done: float | None = None
    """When the wait returned (None: not yet)."""
    nbytes: int = 0
    """Bytes of the full tensor (the ring formulas' message size; a point-to-point batch: its bytes)."""
    size: int = 0
    """Ranks in the group (2 for point-to-point)."""

    def describe(self) -> str:
        where = f", {self.context}" if self.context else ""
        return f"{self.axis} {self.op} #{self.seq} ({self.detail}{where})"


def describe_tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


class FlightRecorder:
    """The last ``capacity`` entries of this process, and the one its host waits on."""

    def __init__(self, capacity: int = 32) -> None:
        self.entries: deque[Entry] = deque(maxlen=capacity)
        self.seq = 0
        self.context = ""
        """Set by the runtime before it runs a step's actions: ``step 2, F1@0``."""
        self.current: Entry | None = None
        """The entry the host is blocked on (None: not in a wait)."""
        self.last_event = time.time()
        """When this rank last posted or finished waiting for an entry."""
        self.explain: Callable[[Entry, BaseException], BaseException | None] | None = None
        """Hook of the runtime's watchdog: an error to raise instead of a failed wait's, or None."""
        self.failed: str | None = None
        """The entry whose wait failed on this rank (set by the watchdog; the rank is on its way out)."""
        self.timings: list[tuple[str, str, int, int, float]] | None = None
        """When a list (the runtime's step timer sets one), every finished wait appends
        ``(op, axis, nbytes, group size, seconds the host blocked)``: what the closed loop
        (``fairscale.closed_loop``) measures collectives and point-to-point by."""
        self._explained: BaseException | None = None
        """The last error ``explain`` made (raised through any call around the wait that made it)."""

    def post(self, op: str, axis: str, detail: str, *, nbytes: int = 0, size: int = 0) -> Entry:
        self.seq += 1
        entry = Entry(self.seq, op, axis, detail, self.context, time.time(), nbytes=nbytes, size=size)
        self.entries.append(entry)
        self.last_event = entry.posted
        return entry

    def wait(self, entry: Entry, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (the blocking part of ``entry``), noting the wait; a failure goes through ``explain``."""
        entry.waiting = time.time()
        start = time.perf_counter()
        outer, self.current = self.current, entry
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised, explained when a watchdog is installed
            self._explain(entry, exc)
            raise
        finally:
            self.current = outer
        entry.done = self.last_event = time.time()
        if self.timings is not None:
            self.timings.append((entry.op, entry.axis, entry.nbytes, entry.size, time.perf_counter() - start))
        return out

    def call(self, entry: Entry, fn: Callable[[], Any], *, explain_if: Callable[[BaseException], bool]) -> Any:
        """Run ``fn``, a call every rank makes together that posts collectives of its own or none
        (``pm.state_dict()``), as ``entry``: the other ranks see this rank in it between its own
        waits, so a rank that never called it is told where this one is. A failure ``explain_if``
        takes for a communication failure, not explained already by a wait inside, is explained."""
        entry.waiting = time.time()
        outer, self.current = self.current, entry
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised, explained when it is a communication failure
            if explain_if(exc):
                self._explain(entry, exc)
            raise
        finally:
            self.current = outer
            entry.done = self.last_event = time.time()  # over, also when it raised
        return out

    def _explain(self, entry: Entry, exc: BaseException) -> None:
        """Raise ``explain``'s error for a failed ``entry`` (once: a call around a wait that already
        raised one lets it through); return to re-raise ``exc`` as it is."""
        if self.explain is None or exc is self._explained:
            return
        better = self.explain(entry, exc)
        if better is not None:
            self._explained = better
            raise better from exc

    def state(self) -> dict[str, Any]:
        """What the other ranks need to know about this one (JSON-able)."""
        cur, last = self.current, (self.entries[-1] if self.entries else None)
        return {"seq": self.seq, "context": self.context, "last_event": self.last_event, "failed": self.failed,
                "waiting": cur.describe() if cur is not None else None,
                "waiting_since": cur.waiting if cur is not None else None,
                "last": last.describe() if last is not None else None}

    def recent(self, n: int = 8) -> list[str]:
        """The last ``n`` entries, oldest first, with their state."""
        now = time.time()
        out = []
        for e in list(self.entries)[-n:]:
            if e.done is not None:
                state = f"done in {e.done - e.posted:.3f} s"
            elif e.waiting is not None:
                state = f"WAITING for {now - e.waiting:.1f} s"
            else:
                state = f"posted {now - e.posted:.1f} s ago, not waited yet"
            out.append(f"{e.describe()}: {state}")
        return out


class TracedWork:
    """An asynchronous collective's work whose ``wait`` goes through the flight record."""

    def __init__(self, work: Any, entry: Entry, recorder: FlightRecorder) -> None:
        self._work = work
        self._entry = entry
        self._recorder = recorder

    def wait(self, timeout: Any = None) -> Any:
        fn = self._work.wait if timeout is None else (lambda: self._work.wait(timeout))
        return self._recorder.wait(self._entry, fn)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


RECORDER = FlightRecorder()
"""This process's flight record (one per rank)."""
