"""The watchdog: no collective of the runtime waits longer than ``collective_timeout_s``, and a rank
that gives up says which rank it was waiting for and where that rank is.

Three parts:

- **Every group gets the timeout.** :func:`collective_timeout` reads the one the world was made
  with (``fairscale.launch(..., collective_timeout_s=)``, or ``init_process_group(timeout=)``
  under torchrun); :func:`group_options` carries it into the groups the runtime creates
  (``fairscale.runtime.mesh``), which torch would otherwise give its 30-minute default. On gloo
  every wait, whether a collective, a point-to-point batch, a data-parallel bucket or an FSDP
  prefetch, then fails after the timeout; under NCCL, torch's own watchdog aborts the rank.
- **A heartbeat.** :func:`install` starts a daemon thread that publishes this rank's flight record
  state (``passes.ops.flight``: the collective it waits on, if any, its last one, when it last
  made progress, the step and schedule action) to the job's store, at most every ``interval``
  seconds and only when it changed. A rank stuck in user code (sleeping in a forward hook, in a
  long kernel) thus leaves behind that it is *not* waiting on anything, and since when.
- **An explanation.** When a wait fails, :func:`explain` (the flight record's hook) reads every
  rank's state and raises :class:`CollectiveTimeoutError` with what this rank waited for, which
  ranks are not in any collective (stuck outside communication: the likely cause), which stopped
  what the others wait on, and this rank's last collectives. (A rank that died is reported by the
  launcher or torchrun, first.) In the spirit of
  NCCL's flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``), read online instead of from dumps.

A stuck rank thus ends the job within ``collective_timeout_s`` plus the launcher's grace: its
peers' waits fail after the timeout, each naming it, and the launcher (or torchrun) stops the rest.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import json
import os
import threading
import time
import weakref
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from passes.ops.flight import RECORDER, Entry

__all__ = ["CollectiveError", "CollectiveTimeoutError", "collective_timeout", "group_options", "install", "explain",
           "collective_call"]

KEY = "fairscale/watchdog/{}"


class CollectiveError(RuntimeError):
    """A collective or point-to-point wait failed; the message says what each rank was doing."""


class CollectiveTimeoutError(CollectiveError):
    """A wait ran past ``collective_timeout_s``."""


Method = TypeVar("Method", bound=Callable[..., Any])


def collective_call(name: str) -> Callable[[Method], Method]:
    """Mark a ``ParallelModule`` method that every rank calls together (``pm.state_dict()``,
    ``pm.save_checkpoint``): while it runs, the other ranks' errors name it as where this rank is
    (nanoGPT checkpoints under ``if master_process:``, so rank 0 gathered alone while the others
    trained on: both timed out with gloo's bare 'Timed out waiting ... for recv', rank 0 named as
    'in no collective'), and a communication failure inside it is explained as a wait's is."""
    def wrap(method: Method) -> Method:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            entry = RECORDER.post("call", "world", f"{name}, which every rank must call together")
            return RECORDER.call(entry, lambda: method(*args, **kwargs), explain_if=_communication_failure)
        return run  # type: ignore[return-value]
    return wrap


def _communication_failure(exc: BaseException) -> bool:
    """A collective's failure (NCCL's DistBackendError, gloo's RuntimeError from its transport),
    not the user's mistake inside a call (a missing checkpoint file)."""
    return isinstance(exc, dist.DistError) or (type(exc) is RuntimeError and "gloo" in str(exc))


def collective_timeout() -> datetime.timedelta | None:
    """The timeout the default process group was made with (None: unknown, torch's default applies)."""
    if not dist.is_initialized():
        return None
    pg = dist.distributed_c10d._get_default_group()
    for device in ("cuda", "cpu"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no backend for this device type
            continue
    return None


def group_options(backend: str, timeout: datetime.timedelta | None) -> Any | None:
    """Backend options carrying ``timeout`` for ``init_device_mesh(backend_override=)`` (None: the
    backend takes no options here, or the timeout is unknown)."""
    if timeout is None:
        return None
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
    else:
        return None
    opts._timeout = timeout
    return opts


class _Heartbeat:
    def __init__(self, store: Any, rank: int, world: int, label: str, interval: float, timeout: float) -> None:
        self.store, self.rank, self.world, self.label = store, rank, world, label
        self.interval, self.timeout = interval, timeout
        self.stop = threading.Event()
        self.premortem: tuple[float, dict[int, dict[str, Any] | None]] | None = None
        self.publish()  # the key exists before anyone reads it
        self.thread = threading.Thread(target=self._run, name="fairscale-watchdog", daemon=True)
        self.thread.start()

    def publish(self) -> None:
        state = json.dumps(dict(RECORDER.state(), rank=self.rank, label=self.label))
        if state != getattr(self, "_last", None):  # a stuck rank stops writing: no noise when the store goes
            self.store.set(KEY.format(self.rank), state)
            self._last = state

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self.publish()
                cur = RECORDER.current
                if cur is not None and cur.waiting is not None and time.time() - cur.waiting > self.timeout / 2:
                    # half-way to a timeout: keep a copy of every rank's state, in case the store's host
                    # (rank 0) times out first and takes the store with it before this rank can read it
                    self.premortem = (time.time(), self.read())
            except Exception:  # noqa: BLE001 - the store is gone (job ending): stop quietly
                return

    def read(self) -> dict[int, dict[str, Any] | None]:
        out: dict[int, dict[str, Any] | None] = {}
        for r in range(self.world):
            key = KEY.format(r)
            out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return out


_ACTIVE: dict[str, Any] = {}


def install(*, label: str = "") -> None:
    """Start this rank's heartbeat and hook :func:`explain` into the flight record (once per process
    and world; again after a new ``init_process_group``). ``label``: this rank's place, e.g.
    ``pp 0, dp 1, tp 1``, named in other ranks' errors. No-op for backends other than gloo and NCCL."""
    if not dist.is_initialized() or dist.get_backend() not in ("gloo", "nccl"):
        return
    world = dist.distributed_c10d._get_default_group()
    beat = _ACTIVE.get("beat")
    same = _ACTIVE.get("pid") == os.getpid() and _ACTIVE["world"]() is world  # a forked rank starts its own
    if beat is not None and same:
        beat.label = label or beat.label
        return
    if beat is not None:
        beat.stop.set()
    timeout = collective_timeout()
    seconds = timeout.total_seconds() if timeout is not None else 1800.0
    beat = _Heartbeat(dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size(), label,
                      interval=min(1.0, max(0.1, seconds / 10)), timeout=seconds)  # >= 10 beats per timeout
    _ACTIVE.update(beat=beat, world=weakref.ref(world), pid=os.getpid())
    RECORDER.explain = explain
    if not _ACTIVE.get("atexit"):
        atexit.register(lambda: _ACTIVE["beat"].stop.set() if _ACTIVE.get("beat") else None)
        _ACTIVE["atexit"] = True


def _ago(now: float, t: float | None) -> str:
    return "?" if t is None else f"{now - t:.1f} s ago"


def explain(entry: Entry, exc: BaseException) -> BaseException | None:
    """The error to raise for a failed wait on ``entry``: what this rank waited for, and where
    every other rank is (from their heartbeats). None leaves ``exc`` as it is."""
    beat: _Heartbeat | None = _ACTIVE.get("beat")
    if beat is None:
        return None
    now = time.time()
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    me = f"rank {beat.rank}" + (f" ({beat.label})" if beat.label else "")
    waited = now - (entry.waiting or entry.posted)
    lines = [f"{me} {'gave up' if timed_out else 'failed'} after waiting {waited:.1f} s "
             f"(collective_timeout_s = {beat.timeout:g}) for {entry.describe()}."]
    RECORDER.failed = entry.describe()
    try:  # tell the others first: a rank that gave up is not stuck
        beat.publish()
    except Exception:  # noqa: BLE001 - the store is gone; say what can be said without it
        pass
    try:
        states = beat.read()
    except Exception as err:  # noqa: BLE001 - e.g. the store's host (rank 0) exited first
        if beat.premortem is not None:
            taken, states = beat.premortem
            lines.append(f"(The other ranks' states as read {now - taken:.1f} s ago: the store is gone now, {err}.)")
        else:
            lines.append(f"The other ranks' states could not be read from the store ({err}).")
            states = {}
    stuck, missing, waiting, failed = [], [], [], []
    for r, s in sorted(states.items()):
        if r == beat.rank:
            continue
        name = f"rank {r}" + (f" ({s['label']})" if s and s.get("label") else "")
        if s is None:
            missing.append(name)
        elif s.get("failed"):
            failed.append(f"{name} on {s['failed']}")
        elif s["waiting"] is None:
            last = f"its last was {s['last']}, " if s.get("last") else ""
            stuck.append((s["last_event"], f"{name} is in no collective: {last}{_ago(now, s['last_event'])}"
                          + (f"; it was last at {s['context']}" if s.get("context") else "")))
        else:
            waiting.append(f"{name} has waited {now - (s['waiting_since'] or now):.1f} s in {s['waiting']}")
    if stuck:
        stuck.sort()
        lines.append("Stuck outside communication (in compute, data loading or user code such as a hook), or slower "
                     "than the timeout: " + "; ".join(t for _, t in stuck) + ".")
    if missing:
        lines.append("Never reported (not started, or no runtime mesh): " + ", ".join(missing) + ".")
    if waiting:
        lines.append("Waiting too: " + "; ".join(waiting) + ".")
    if failed:
        lines.append("Gave up too: " + "; ".join(failed) + ".")
    if states and not stuck and not missing:
        lines.append("Every rank is in a collective, so they wait on each other: a collective or message that some "
                     "ranks post and others do not, or post in another order.")
    lines.append("This rank's last collectives, oldest first:\n  " + "\n  ".join(RECORDER.recent()))
    lines.append(f"The error: {text}")
    cls = CollectiveTimeoutError if timed_out else CollectiveError
    return cls("\n".join(lines))
