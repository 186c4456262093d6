"""Run a function on N ranks: forked CPU processes on a laptop, or the ranks torchrun launched.

Usage::

    import fairscale

    def train(rank, world_size, steps):
        ...                       # torch.distributed is initialized here
        return loss

    losses = fairscale.launch(train, devices=4, args=(3,))   # one result per rank

Outside torchrun, ranks are forked from the calling process (fork context), so they inherit
everything the parent built: a captured graph, a plan, a model. Forking 8 ranks takes 2–3 s,
where spawn takes 13–35 s. Each rank runs with one intra-op thread.

If a rank raises or dies, the launcher kills the others and raises :class:`RankFailedError`
with every failed rank's traceback, after at most ``grace_s`` seconds; nothing hangs. Inside
torchrun (``RANK``/``WORLD_SIZE`` set), ``launch`` runs ``fn`` once in this process on the
launched rank and returns a one-element list.
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from fairscale.runtime.startup import ENV_STARTUP_TIMEOUT

__all__ = ["launch", "RankFailedError", "init_distributed", "under_torchrun"]


class RankFailedError(RuntimeError):
    """One or more ranks failed; ``failures`` maps rank -> traceback text; ``lost`` holds the ranks
    whose process died without reporting (a signal such as SIGKILL, or an exit without a result):
    ``fairscale run --max-restarts`` counts their devices as gone."""

    def __init__(self, failures: dict[int, str], world_size: int, *, lost: frozenset[int] = frozenset()) -> None:
        self.failures = dict(failures)  # in order of arrival: the first is usually the root cause
        self.world_size = world_size
        self.lost = frozenset(lost)
        first = next(iter(failures))
        ranks = ", ".join(str(r) for r in failures)
        detail = "\n".join(f"--- rank {r} ---\n{t.rstrip()}" for r, t in failures.items())
        super().__init__(f"rank {first} failed first (failed: {ranks} of {world_size}); "
                         f"the other ranks were stopped.\n{detail}")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so no orphan rank keeps waiting."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def init_distributed(*, rank: int, world_size: int, init_method: str, backend: str | None = None,
                     timeout_s: float = 120.0) -> None:
    """Initialize the default process group (gloo on CPU, NCCL when CUDA is present). Under NCCL
    the current CUDA device is set from ``LOCAL_RANK`` first (not the global rank: rank 9 of two
    8-GPU nodes is ``cuda:1``), so NCCL's context lands on this rank's own GPU."""
    if backend is None:
        backend = "nccl" if torch.cuda.device_count() > 0 else "gloo"  # device_count asks NVML: no context
    if backend == "nccl":
        from fairscale.runtime.device import resolve_device_for_backend

        torch.cuda.set_device(resolve_device_for_backend("nccl"))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    # gloo connects each pair of ranks in init; a rank whose pairs are done may go on and even exit
    # (a script that does nothing collective) while a slower rank still reads its handshake, which
    # then fails with "Connection closed by peer". No rank leaves init before all have connected.
    dist.barrier()


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, init_method: str, args: Sequence[Any],
               kwargs: dict[str, Any], conn: Any, backend: str | None, timeout_s: float, threads: int,
               env: dict[str, str]) -> None:
    _die_with_parent()
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      FAIRSCALE_LAUNCHED="1", **env)
    try:
        init_distributed(rank=rank, world_size=world_size, init_method=init_method, backend=backend,
                         timeout_s=timeout_s)
        result = fn(rank, world_size, *args, **kwargs)
        # Plain pickle, by value: multiprocessing's ForkingPickler would pass tensors as shared-memory
        # file descriptors, which vanish when this rank exits before the parent reads them.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent, then we exit
        try:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        finally:
            os._exit(1)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - teardown after a sent result must not mask it
                pass
    conn.close()
    os._exit(0)


def _fork_poisoned() -> bool:
    """Whether a process forked now could not use CUDA. ``torch.cuda.is_initialized()`` misses a
    process that only asked the CUDA runtime for its devices (``torch.cuda.is_available()``, or a
    library probing the GPU during a model's forward), which already poisons fork: a child forked
    here reads torch's own flag and answers through a pipe (a few milliseconds)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the probe child: answer and leave without running any of the parent's exit handlers
        try:
            os.write(write, b"1" if torch.cuda._is_in_bad_fork() else b"0")
        finally:
            os._exit(0)
    os.close(write)
    try:
        answer = os.read(read, 1)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    return answer == b"1"


def launch(fn: Callable[..., Any], devices: int, *, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
           backend: str | None = None, timeout_s: float | None = None, collective_timeout_s: float = 120.0,
           startup_timeout_s: float | None = None, grace_s: float = 5.0, threads_per_rank: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``devices`` ranks and return their results.

    Args:
        fn: the per-rank function; torch.distributed is initialized when it runs.
        devices: number of ranks to fork (ignored under torchrun, which fixes the world).
        args, kwargs: extra arguments; with fork they are inherited, not pickled.
        backend: ``gloo`` or ``nccl``; default NCCL when CUDA is available, else gloo.
        timeout_s: wall-clock limit for the whole run; default none (training runs as long as it
            needs; a stuck collective still fails after ``collective_timeout_s``).
        collective_timeout_s: a collective that waits longer than this fails on its rank.
        startup_timeout_s: how long ranks wait for each other's build-time work (capture, the compile
            check, a first calibration) before the collectives that need it
            (:mod:`fairscale.runtime.startup`); default ``FAIRSCALE_STARTUP_TIMEOUT_S``, else 30 minutes.
        grace_s: after the first failure, how long the others get to report before being killed.
        threads_per_rank: intra-op threads per rank.

    Interrupts: SIGINT (Ctrl-C) or SIGTERM to the launching process stops every rank (SIGTERM,
    then SIGKILL after 1 s) before ``KeyboardInterrupt`` (SIGINT) or ``SystemExit(143)`` (SIGTERM)
    leaves ``launch``; a launcher killed outright takes its ranks with it (parent-death signal).
    """
    kwargs = dict(kwargs or {})
    env: dict[str, str] = {}  # what the ranks read (forked ranks, or this process under torchrun)
    if startup_timeout_s is not None:
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be positive, got {startup_timeout_s}")
        env[ENV_STARTUP_TIMEOUT] = repr(float(startup_timeout_s))
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if not dist.is_initialized():
            init_distributed(rank=rank, world_size=world, init_method="env://", backend=backend,
                             timeout_s=collective_timeout_s)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return [fn(rank, world, *args, **kwargs)]
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    uses_cuda = backend == "nccl" or (backend is None and torch.cuda.device_count() > 0)  # NVML: no context
    if torch.cuda.is_initialized() or (uses_cuda and _fork_poisoned()):
        raise RuntimeError(
            "CUDA was initialized in this process before fairscale.launch forked its ranks, and a forked process "
            "cannot use CUDA (\"Cannot re-initialize CUDA in forked subprocess\"). Launch before touching CUDA "
            "(no .cuda(), torch.cuda.get_device_properties or torch.cuda.is_available() first, nor a model run "
            "whose library asks them, as Hugging Face models' forward may; torch.cuda.device_count() is safe), "
            "or run the script under torchrun (`torchrun --nproc_per_node N script.py`), which starts fresh "
            "processes")

    ctx = mp.get_context("fork")
    # The ranks meet in a file store in a directory of this launch's own: a TCP store's port, picked
    # free here and bound later by rank 0, could be taken in between by another launch on the
    # machine, whose ranks would then rendezvous with these.
    store_dir = tempfile.mkdtemp(prefix="fairscale-launch-")
    init_method = f"file://{store_dir}/store"
    procs, conns = [], []
    for rank in range(devices):
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, name=f"fairscale-rank{rank}",
                        args=(fn, rank, devices, init_method, args, kwargs, child_end, backend,
                              collective_timeout_s, threads_per_rank, env))
        p.start()
        child_end.close()
        procs.append(p)
        conns.append(parent_end)
    previous = _on_sigterm()
    try:
        return _collect(procs, conns, timeout_s=timeout_s, grace_s=grace_s)
    finally:  # an interrupt, or any error of the launcher itself: no rank outlives the launch
        _stop(procs)
        shutil.rmtree(store_dir, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _on_sigterm() -> Any:
    """Make SIGTERM raise ``SystemExit(143)`` (the shell's 128 + 15) in the launcher while ranks
    run, so the ``finally`` that stops them runs; returns the handler to restore (None when not on
    the main thread, where Python cannot install one)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def terminated(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, terminated)


def _stop(procs: list[Any], *, wait_s: float = 1.0) -> None:
    """SIGTERM every live rank, then SIGKILL what is left after ``wait_s``."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    end = time.monotonic() + wait_s
    for p in alive:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _collect(procs: list[Any], conns: list[Any], *, timeout_s: float | None, grace_s: float) -> list[Any]:
    n = len(procs)
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}  # insertion order = order of arrival: the root cause comes first
    lost: set[int] = set()  # died without reporting (before the launcher stopped anything)
    deadline = time.monotonic() + timeout_s if timeout_s is not None else float("inf")
    first_failure: float | None = None
    while len(results) + len(failures) < n:
        now = time.monotonic()
        if now > deadline:
            for r in range(n):
                if r not in results and r not in failures:
                    failures[r] = f"still running after the launch timeout of {timeout_s:.0f} s"
            break
        if first_failure is not None and now > first_failure + grace_s:
            for r in range(n):
                if r not in results and r not in failures:
                    failures[r] = "stopped by the launcher after another rank failed"
            break
        progressed = False
        for r, (p, c) in enumerate(zip(procs, conns)):
            if r in results or r in failures:
                continue
            if c.poll():
                try:
                    status, payload = pickle.loads(c.recv_bytes())
                except EOFError:
                    status, payload = "error", None
                if status == "ok":
                    results[r] = payload
                else:
                    failures[r] = payload or _death_text(p)
                    if payload is None:
                        lost.add(r)
                    first_failure = first_failure or time.monotonic()
                progressed = True
            elif not p.is_alive():
                if c.poll():  # result arrived between the two checks
                    continue
                failures[r] = _death_text(p)
                lost.add(r)
                first_failure = first_failure or time.monotonic()
                progressed = True
        if not progressed:
            time.sleep(0.005)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=5)
    for c in conns:
        c.close()
    # A rank that died silently is the likeliest root cause: the others then fail on a closed socket.
    silent = {r: t for r, t in failures.items() if r in lost}
    real = silent | {r: t for r, t in failures.items() if not t.startswith("stopped by the launcher")}
    if failures:
        raise RankFailedError(real or failures, n, lost=frozenset(lost))
    return [results[r] for r in range(n)]


def _death_text(p: Any) -> str:
    p.join(timeout=0.1)
    code = p.exitcode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"process died from signal {name} without reporting a result"
    return f"process exited with code {code} without reporting a result"
