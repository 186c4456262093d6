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
"""

from __future__ import annotations

import resource
from typing import Any

from passes.ops.flight import RECORDER

__all__ = ["CpuIn", "cpu_s"]


def cpu_s() -> float:
    """CPU seconds this process has used, every thread (gloo's included), user and system."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


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
