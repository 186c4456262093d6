"""Interrupts reach every rank (issue 15, item 2): SIGINT or SIGTERM to the launching process alone
stops all ranks within seconds, and the launcher exits with the conventional code (130 / 143).
There is no wall-clock deadline by default (item 6)."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fairscale.runtime.launch import launch
from fairscale.runtime.run_cli import run_script

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import os, sys, time
    import fairscale

    def forever(rank, world, pids):
        path = os.path.join(pids, str(rank))
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)  # the test never sees a created but empty file
        while True:
            time.sleep(0.05)

    fairscale.launch(forever, devices=3, args=(sys.argv[1],))
""")


RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time
    path = os.path.join(sys.argv[1], os.environ["RANK"])
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)  # the test never sees a created but empty file
    while True:
        time.sleep(0.05)
""")


def _written(pids: Path) -> list[Path]:
    """The ranks' pid files written so far (each appears whole: written aside, then renamed)."""
    return [p for p in pids.iterdir() if p.suffix != ".tmp"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("how", ["launch", "fairscale run"])
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_alone_stops_every_rank(tmp_path: Path, sig: signal.Signals, code: int,
                                                         how: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT if how == "launch" else RANK_SCRIPT)
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(script), str(pids)] if how == "launch" else [
        sys.executable, "-m", "fairscale", "run", "--devices", "3", str(script), str(pids)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE,
                            start_new_session=True)  # its own group: the signal goes to the launcher alone
    deadline = time.monotonic() + 60
    while len(_written(pids)) < 3:
        assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not start"
        time.sleep(0.05)
    ranks = [int(p.read_text()) for p in _written(pids)]
    sent = time.monotonic()
    proc.send_signal(sig)
    proc.wait(timeout=30)  # its own exit (interpreter teardown) is slow on a loaded machine
    waited = time.monotonic() - sent
    assert proc.returncode in (code, -sig), (proc.returncode, proc.stderr.read().decode()[-2000:] if proc.stderr else "")
    while any(_alive(pid) for pid in ranks) and time.monotonic() - sent < 5:
        time.sleep(0.05)
    assert not [pid for pid in ranks if _alive(pid)], "ranks outlived the launcher"
    assert waited < 30, f"the launcher took {waited:.1f} s to exit"


def test_no_deadline_by_default() -> None:
    assert inspect.signature(launch).parameters["timeout_s"].default is None
    assert inspect.signature(run_script).parameters["timeout_s"].default is None
