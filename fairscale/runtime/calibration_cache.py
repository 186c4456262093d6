"""The machine's calibration, measured once and cached: what CPU clusters are planned with.

The first time a machine plans for N CPU ranks (``fairscale.plan`` / ``search``, ``fairscale
plan``), :func:`cpu_cluster` measures it with ``fairscale.runtime.calibrate.calibrate_cpu`` (N
forked gloo ranks, then the runtime's host work on real training steps of the same ranks) and
caches the result under the user's cache directory, keyed by a fingerprint of the machine (CPU
model, cores, memory, OS, torch version) and the rank count. Later plans read the cache; ``fairscale calibrate`` re-measures.

    FAIRSCALE_NO_CALIBRATE=1    never measure: plan with the cache if there is one, else the
                                datasheet-style defaults of ``planner.cluster.Cluster.cpu``
    FAIRSCALE_CACHE_DIR=path    where calibrations live (default ``$XDG_CACHE_HOME/fairscale``,
                                else ``~/.cache/fairscale``)

Inside launched ranks (``parallelize``) nothing is measured: the cache is only read, since the
ranks must agree on one plan and a measurement needs a world of its own. The cluster's ``name``
says which figures a plan used: ``cpu-calibrated`` (and the report shows its measured rates) or
``cpu`` (the defaults).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from fairscale.runtime.calibrate import (CALIBRATION_VERSION, Calibration, RuntimeHostProbe, calibrate_cpu,
                                         machine_description, save_calibration)
from planner.cluster import Cluster

__all__ = ["cpu_cluster", "calibrate_and_cache", "cache_path", "cache_root", "machine_fingerprint", "write_whole", "REPEAT"]

REPEAT = 2
"""Timed repetitions per measurement: with 2, first use takes 15-18 s for 8 ranks on 2 cores (the
rates and collectives about 6 s, the runtime's host work on four real plans the rest; the message
says which took what)."""


def machine_fingerprint() -> str:
    """A short hash of what the measured rates depend on (not the load or the time of day)."""
    m = machine_description()
    key = json.dumps({k: m[k] for k in ("cpu", "cores", "memory_bytes", "os", "torch")}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def cache_root() -> Path:
    """``FAIRSCALE_CACHE_DIR``, else ``$XDG_CACHE_HOME/fairscale``, else ``~/.cache/fairscale``."""
    return Path(os.environ.get("FAIRSCALE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fairscale"))


def cache_path(ranks: int) -> Path:
    return cache_root() / "calibration" / f"cpu-{machine_fingerprint()}-{ranks}ranks.json"


def _read(path: Path) -> Cluster | None:
    try:
        data = json.loads(path.read_text())
        if data.get("version", 1) != CALIBRATION_VERSION:
            return None  # measured fewer terms than the cost model now uses
        return Calibration.from_dict(data).cluster
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent, or written by another version: measure again


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """Write a cache file through ``write(tmp)`` beside it, then move it into place: a reader (another
    process planning at the same time) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    write(tmp)
    tmp.replace(path)


def calibrate_and_cache(ranks: int, *, out: object = None, runtime_host: RuntimeHostProbe | None = None) -> Cluster:
    """Measure ``ranks`` CPU ranks now and replace the cached calibration; returns its Cluster.
    ``runtime_host``: ``fairscale.calibrate_host.measure_runtime_host`` (the face hands it in)."""
    stream = out if out is not None else sys.stderr
    path = cache_path(ranks)
    print(f"calibrating this machine for {ranks} CPU ranks (about 20-27 s for 8 ranks on 2 cores; cached in {path}) ...",
          file=stream, flush=True)  # type: ignore[arg-type]
    start = time.perf_counter()
    cal = calibrate_cpu(ranks, repeat=REPEAT, runtime_host=runtime_host)
    write_whole(path, lambda tmp: save_calibration(cal, tmp))
    flops = cal.cluster.peak_flops["fp32"]
    parts = ", ".join(f"{name.replace('_', ' ')} {secs:.1f} s" for name, secs in cal.machine.get("calibration_s", {}).items()
                      if secs > 0.05)
    print(f"calibrated in {time.perf_counter() - start:.1f} s ({parts}): {flops / 1e9:.1f} GFLOP/s per rank, "
          f"{cal.memory_bandwidth / 1e9:.1f} GB/s memory, all-reduce alpha "
          f"{cal.cluster.intra_latency * 1e6:.0f} us, {cal.cluster.intra_bandwidth / 1e9:.2f} GB/s",
          file=stream, flush=True)  # type: ignore[arg-type]
    return cal.cluster


def cpu_cluster(ranks: int, *, memory_bytes: int | None = None, runtime_host: RuntimeHostProbe | None = None) -> Cluster:
    """The Cluster to plan ``ranks`` CPU ranks of this machine with: the cached calibration, else a
    new one (first use, outside launched ranks, unless ``FAIRSCALE_NO_CALIBRATE``), else
    ``Cluster.cpu``. One rank has no collectives to measure: ``Cluster.cpu``. ``runtime_host`` as
    :func:`calibrate_and_cache`."""
    if ranks >= 2:
        found = _read(cache_path(ranks))
        if found is None and not os.environ.get("FAIRSCALE_NO_CALIBRATE") and not dist.is_initialized():
            found = calibrate_and_cache(ranks, runtime_host=runtime_host)
        if found is not None:
            if memory_bytes is not None:
                found = Cluster.from_dict({**found.to_dict(), "memory_bytes": memory_bytes})
            return found
    return Cluster.cpu(ranks, memory_bytes=memory_bytes)
