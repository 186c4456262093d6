"""``fairscale run --max-restarts``: what a restart keeps and what it loses, on scripts without a
model (fast), and the world shrinking a plan that uses fewer devices needs."""

from __future__ import annotations

import io
import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fairscale
from fairscale.cli import main
from fairscale.elastic_world import regroup
from fairscale.runtime.run_cli import run_script

# Each start appends (restart, rank, world, checkpoint dir, every) to a file per rank; then the
# script misbehaves as told by argv[2] on the first start: "raise" (rank 1 raises), "kill" (rank 2
# dies from SIGKILL), "always" (rank 1 raises on every start), anything else: nothing.
SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    out, how = sys.argv[1], sys.argv[2]
    rank, restart = int(os.environ["RANK"]), int(os.environ["FAIRSCALE_RESTART_COUNT"])
    with open(f"{out}.{rank}", "a") as f:
        f.write(json.dumps([restart, rank, int(os.environ["WORLD_SIZE"]), os.environ.get("FAIRSCALE_CHECKPOINT_DIR"),
                            os.environ.get("FAIRSCALE_CHECKPOINT_EVERY")]) + "\\n")
    if how == "raise" and restart == 0 and rank == 1 or how == "always" and rank == 1:
        raise RuntimeError("a bug on rank 1")
    if how == "kill" and restart == 0 and rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
""")


def _starts(out: Path, ranks: int) -> list[list[object]]:
    rows = []
    for r in range(ranks):
        path = Path(f"{out}.{r}")
        if path.exists():
            rows += [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(rows, key=lambda row: (row[0], row[1]))  # type: ignore[arg-type, return-value]


def _run(tmp_path: Path, how: str, **kw: object) -> tuple[int, str, list[list[object]]]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out, err = tmp_path / "starts", io.StringIO()
    code = run_script(str(script), 3, [str(out), how], stderr=err, **kw)  # type: ignore[arg-type]
    return code, err.getvalue(), _starts(out, 3)


def test_a_rank_that_raised_keeps_its_device(tmp_path: Path) -> None:
    code, log, starts = _run(tmp_path, "raise", max_restarts=1, checkpoint_dir=str(tmp_path / "ck"),
                             checkpoint_every=5)
    assert code == 0, log
    assert "RuntimeError: a bug on rank 1" in log and "restarting on 3 devices (restart 1 of 1); resuming from the " \
        f"last checkpoint in {tmp_path / 'ck'}" in log
    assert starts == [[restart, r, 3, str(tmp_path / "ck"), "5"] for restart in (0, 1) for r in range(3)]


def test_a_rank_that_died_takes_its_device(tmp_path: Path) -> None:
    code, log, starts = _run(tmp_path, "kill", max_restarts=2)
    assert code == 0, log
    assert "rank 2 failed first" in log and "died from signal SIGKILL" in log
    assert "restarting on 2 devices (restart 1 of 2; lost rank 2)" in log
    directory = starts[0][3]  # no --checkpoint-dir: a temporary one, the same for every start
    assert isinstance(directory, str) and directory.startswith(os.environ.get("TMPDIR", "/tmp"))
    assert [row[:3] for row in starts] == [[0, 0, 3], [0, 1, 3], [0, 2, 3], [1, 0, 2], [1, 1, 2]]
    assert all(row[3] == directory and row[4] is None for row in starts)
    assert not Path(directory).exists()  # removed once the job succeeded


def test_restarts_run_out(tmp_path: Path) -> None:
    code, log, starts = _run(tmp_path, "always", max_restarts=1, checkpoint_every=2)
    assert code == 1
    assert log.count("RuntimeError: a bug on rank 1") == 2 and "fairscale run: stopped: no restart is left (--max-restarts 1)" in log
    kept = starts[0][3]
    assert isinstance(kept, str) and f"checkpoints kept in {kept}; resume with --checkpoint-dir {kept}" in log
    assert Path(kept).is_dir()


def test_without_restarts_a_failure_says_how_to_restart(tmp_path: Path) -> None:
    code, log, starts = _run(tmp_path, "kill")
    assert code == 1 and "stopped: give --max-restarts K to restart on the devices that are left" in log
    assert [row[0] for row in starts] == [0, 0, 0] and starts[0][3] is None  # no checkpoint directory asked for


def test_the_cli_passes_the_restart_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = tmp_path / "starts"
    code = main(["run", "--devices", "3", "--max-restarts", "1", "--checkpoint-every", "4", "--checkpoint-dir",
                 str(tmp_path / "ck"), str(script), str(out), "kill"])
    assert code == 0, capsys.readouterr().err
    assert [row[:3] for row in _starts(out, 3)][-2:] == [[1, 0, 2], [1, 1, 2]]
    assert main(["run", "--devices", "2", "--max-restarts", "-1", str(script)]) == 2
    assert "--max-restarts must be >= 0, got -1" in capsys.readouterr().err


def _regrouped(rank: int, world: int, n: int) -> tuple[bool, int, float] | tuple[bool]:
    if not regroup(n):
        return (dist.is_initialized(),)
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    return True, dist.get_world_size(), float(x)


def test_regroup_keeps_the_first_ranks_and_lets_the_others_go() -> None:
    got = fairscale.launch(_regrouped, devices=4, args=(2,))
    assert got == [(True, 2, 3.0), (True, 2, 3.0), (False,), (False,)]
