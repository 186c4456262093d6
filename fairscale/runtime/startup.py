"""Build-time rendezvous: ranks wait for each other's slow local work under a startup deadline.

Before a model trains, each rank does long work of its own: it captures the model (an export can
take minutes for a large model on a loaded machine), rank 0 calibrates the machine or runs the
plan-time compile check, every rank compiles its share. The first collective after such work waits
for the slowest rank; under the collective watchdog's timeout (``fairscale.launch(...,
collective_timeout_s=120)``, sized to catch a stuck *step*) a slow capture ended the job with a
collective timeout, though nothing was wrong (seen in the corpus run at load 50).

So the build-time collectives are preceded by :func:`rendezvous`: every rank records in the job's
store that it reached the point, then waits for the others there, under :func:`startup_timeout` (``FAIRSCALE_STARTUP_TIMEOUT_S``, default 30
minutes, or ``fairscale.launch(..., startup_timeout_s=)``). The collective that follows starts
when everyone is there, so the short watchdog still guards it. While it waits, a rank says every
minute on stderr which ranks it waits for and since when; at the deadline it raises
:class:`StartupTimeoutError` naming them. A rank that died is reported by the launcher first.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import weakref
from typing import Any, Callable, TypeVar

import torch.distributed as dist

__all__ = ["StartupTimeoutError", "broadcast_from_zero", "on_zero", "rendezvous", "startup_timeout", "ENV_STARTUP_TIMEOUT"]

T = TypeVar("T")

ENV_STARTUP_TIMEOUT = "FAIRSCALE_STARTUP_TIMEOUT_S"
DEFAULT_STARTUP_TIMEOUT_S = 1800.0
PROGRESS_EVERY_S = 60.0

_STATE: dict[str, Any] = {}


class StartupTimeoutError(RuntimeError):
    """Ranks did not reach a build-time rendezvous within the startup deadline."""


def startup_timeout() -> float:
    """Seconds a rank waits at a rendezvous: ``FAIRSCALE_STARTUP_TIMEOUT_S``, default 1800."""
    raw = os.environ.get(ENV_STARTUP_TIMEOUT, "")
    if not raw:
        return DEFAULT_STARTUP_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_STARTUP_TIMEOUT}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{ENV_STARTUP_TIMEOUT}={raw!r} must be positive")
    return value


def _index() -> int:
    """This rank's count of rendezvous in the current default group (every rank calls them in the
    same order, so the counts agree; a new group, e.g. after ``regroup``, starts again)."""
    world = dist.distributed_c10d._get_default_group()
    if _STATE.get("pid") != os.getpid() or _STATE["world"]() is not world:
        _STATE.update(pid=os.getpid(), world=weakref.ref(world), n=0)
    _STATE["n"] += 1
    return int(_STATE["n"])


def rendezvous(what: str, *, timeout_s: float | None = None) -> None:
    """Wait until every rank has reached this point, for at most the startup deadline
    (``timeout_s``, default :func:`startup_timeout`). ``what`` names the work being waited for in
    messages ("capturing the model")."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    prefix = f"fairscale/startup/{_index()}"
    store.set(f"{prefix}/{rank}", what)
    keys = {r: f"{prefix}/{r}" for r in range(world) if r != rank}
    limit = startup_timeout() if timeout_s is None else timeout_s
    start = time.monotonic()
    while keys:
        left = limit - (time.monotonic() - start)
        if left <= 0:
            raise StartupTimeoutError(
                f"rank {rank} waited {limit:g} s for rank(s) {sorted(keys)} to finish {what} and reach the "
                f"same point; they are still busy or stuck there. A large model on a slow or loaded machine "
                f"may need longer: set {ENV_STARTUP_TIMEOUT} or fairscale.launch(..., startup_timeout_s=)")
        chunk = min(PROGRESS_EVERY_S, left)
        began = time.monotonic()
        try:
            store.wait(list(keys.values()), datetime.timedelta(seconds=chunk))
            return
        except RuntimeError:  # DistStoreError: this wait's timeout, or the store is gone (its host died)
            if time.monotonic() - began < 0.9 * chunk:
                raise
        keys = {r: k for r, k in keys.items() if not store.check([k])}
        if keys:
            print(f"fairscale: rank {rank} waiting {time.monotonic() - start:.0f} s for rank(s) {sorted(keys)} "
                  f"to finish {what}", file=sys.stderr, flush=True)


def broadcast_from_zero(box: list[Any], what: str) -> None:
    """``dist.broadcast_object_list(box, src=0)`` after global rank 0 finished ``what`` (its slow
    work whose result ``box`` carries). Every rank waits for every other under the startup deadline
    first: the root of a gloo broadcast also waits for the receivers, which may still be busy with
    their own build-time work."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rendezvous(what)
    dist.broadcast_object_list(box, src=0)


def on_zero(work: Callable[[], T], what: str) -> T:
    """``work()`` done once, on global rank 0, and its result sent to every rank. For work that is
    costly and the same on every rank (a capture, a search, a costing): 8 ranks sharing 2 cores
    would each do it again. Where rank 0 raises, every other rank does the work itself, to raise
    the same error (an exception does not travel). Collective."""
    box: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            box = [work()]
        finally:  # a failure still reaches the others, which then raise it themselves
            broadcast_from_zero(box, what)
    else:
        broadcast_from_zero(box, what)
    if box[0] is None:
        work()
        raise RuntimeError(f"global rank 0 failed {what}, but this rank did not; see rank 0's error")
    return box[0]

