"""CPU seconds of a rank's process, and the part of a step's spent in waits and in the optimizer.

Usage::

    from fairscale.runtime.cpu_meter import CpuIn, cpu_s
    meter = CpuIn(pm)                 # wraps the flight recorder's waits and pm.optimizer.step
    meter.reset(); start = cpu_s()
    pm.train_step(batch)
    compute = cpu_s() - start - meter.wait - meter.opt
    meter.close()

Used by the runtime-host calibration (``fairscale.calibrate_host``) and the end-to-end benchmark's
CPU-per-term table: process CPU time counts every thread (gloo's included), user and system, so on
ranks that share cores it is what a step costs the machine, whatever other users' load does to
the wall clock.

:func:`core_times` reads what the machine's cores did meanwhile (Linux ``/proc/stat``): seconds
idle, and seconds a virtual machine's hypervisor took (steal). On ranks that time-share cores, the
idle seconds of a step over the ranks' CPU seconds are ``Cluster.core_idle``: cores left idle while
ranks wait on each other. Another process's work fills idle cores and shows as busy, not idle, so
other users' load makes this smaller, never larger (the wall clock's ratio to the CPU work grew
with load: 28% measured under a nice-5 neighbour, 7-12% quiet).
"""

from __future__ import annotations

import os
import resource
from typing import Any

from passes.ops.flight import RECORDER

__all__ = ["CpuIn", "cpu_s", "core_times"]


def cpu_s() -> float:
    """CPU seconds this process has used, every thread (gloo's included), user and system."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def core_times(path: str = "/proc/stat") -> tuple[float, float] | None:
    """(idle, steal): seconds all the machine's cores have spent idle (waiting for I/O included) and
    taken by a hypervisor since boot, summed over the cores, from ``/proc/stat``; None where there
    is no such file (not Linux). Differences of two readings are what the cores did in between."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]] + [0] * max(0, 9 - len(fields))  # user nice system idle iowait irq softirq steal
    hz = os.sysconf("SC_CLK_TCK")
    return (ticks[3] + ticks[4]) / hz, ticks[7] / hz


class CpuIn:
    """CPU seconds of this process (every thread) spent inside the flight recorder's waits
    (collectives and point-to-point) and inside ``pm``'s optimizer step, since :meth:`reset`.
    The runtime is unchanged: the recorder's ``wait`` and the optimizer's ``step`` are wrapped
    on this object's life and restored by :meth:`close`."""

    def __init__(self, pm: Any) -> None:
        self.wait = self.opt = 0.0
        self._pm, self._wait, self._step = pm, RECORDER.wait, pm.optimizer.step

        def wait(entry: Any, fn: Any) -> Any:
            c = cpu_s()
            try:
                return self._wait(entry, fn)
            finally:
                self.wait += cpu_s() - c

        def step(*a: Any, **k: Any) -> Any:  # its waits (ZeRO's all-gather) count as waits
            c, w = cpu_s(), self.wait
            try:
                return self._step(*a, **k)
            finally:
                self.opt += cpu_s() - c - (self.wait - w)
        RECORDER.wait = wait  # type: ignore[method-assign]
        pm.optimizer.step = step

    def reset(self) -> None:
        self.wait = self.opt = 0.0

    def close(self) -> None:
        del RECORDER.wait  # the class's method again
        del self._pm.optimizer.step
