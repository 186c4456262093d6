"""What the machine's cores did (fairscale.runtime.cpu_meter.core_times): idle and hypervisor
seconds read from /proc/stat's first line, summed over the cores."""

import os

import pytest

from fairscale.runtime.cpu_meter import core_times


def test_core_times_reads_idle_and_steal_summed_over_the_cores(tmp_path):
    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 5 50 1000 20 1 2 7 0 0\ncpu0 50 2 25 500 10 0 1 3 0 0\n")
    assert core_times(str(stat)) == ((1000 + 20) / hz, 7 / hz)  # waiting for I/O is idle too
    stat.write_text("cpu  100 5 50 1000\n")  # an old kernel without the later columns
    assert core_times(str(stat)) == (1000 / hz, 0.0)
    assert core_times(str(tmp_path / "missing")) is None  # not Linux: the calibration says 0
    stat.write_text("intr 1 2 3\n")
    assert core_times(str(stat)) is None


def test_core_times_of_this_machine_only_grow():
    first = core_times()
    if first is None:
        pytest.skip("no /proc/stat (not Linux)")
    second = core_times()
    assert second is not None and all(b >= a >= 0 for a, b in zip(first, second))
