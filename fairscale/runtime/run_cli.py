"""``python -m fairscale run --devices N script.py [args...]``: run a script on N CPU ranks.

Each rank is a forked process with ``torch.distributed`` initialized (gloo) and ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` set, as torchrun would; the script runs as ``__main__`` with
``sys.argv = [script, *args]``. Scripts written for torchrun work unchanged, and so do scripts
that call ``fairscale.launch(fn, devices=...)``: inside a launched rank it runs ``fn`` once on
that rank. If any rank fails the others are stopped and every failed rank's traceback is printed.

``--max-restarts K`` starts the script again after a failure, on the devices that are left, and
``--checkpoint-every S`` / ``--checkpoint-dir D`` tell ``fairscale.train`` (``fairscale.elastic``)
in the script how often to checkpoint and where to resume from (see :func:`run_script`).
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Sequence, TextIO

from fairscale.runtime.launch import RankFailedError, launch

__all__ = ["run_script", "ENV_DIR", "ENV_EVERY", "ENV_RESTART", "ENV_CALIBRATE"]

ENV_DIR = "FAIRSCALE_CHECKPOINT_DIR"
"""Set on every rank by ``--checkpoint-dir``: ``fairscale.train``'s default checkpoint directory."""
ENV_EVERY = "FAIRSCALE_CHECKPOINT_EVERY"
"""Set on every rank by ``--checkpoint-every``: ``fairscale.train``'s default checkpoint interval."""
ENV_CALIBRATE = "FAIRSCALE_CALIBRATE"
"""Set on every rank by ``--calibrate`` (the steps to time): ``fairscale.parallelize``'s default
``calibrate`` (``fairscale.closed_loop``)."""
ENV_RESTART = "FAIRSCALE_RESTART_COUNT"
"""Set on every rank: how many times the job was restarted (0 on the first start)."""


class ScriptExit(RuntimeError):
    """The script called ``sys.exit`` with a non-zero status on a rank."""


def _run_rank(rank: int, world: int, script: str, argv: list[str], env: dict[str, str]) -> None:
    os.environ.update(env)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise ScriptExit(f"{script} exited with status {exc.code} on rank {rank}") from None
    return None


def run_script(script: str, devices: int, argv: Sequence[str] = (), *, timeout_s: float | None = None,
               max_restarts: int = 0, checkpoint_dir: str | None = None, checkpoint_every: int | None = None,
               calibrate_steps: int | None = None, stderr: TextIO | None = None) -> int:
    """Run ``script`` on ``devices`` forked ranks; return the process exit status (0 = every rank
    succeeded, 1 = a rank failed, 130 = interrupted with Ctrl-C; SIGTERM exits 143). No wall-clock
    limit unless ``timeout_s`` (per start); every rank is stopped on any way out.

    Restarts: when a rank fails, the job starts again, at most ``max_restarts`` times, on the
    devices that are left: a rank whose process died without reporting (SIGKILL, a crash) takes
    its device with it; a rank that raised leaves its device usable. ``fairscale.train`` in the
    script then re-plans for the new count and resumes from the last checkpoint in
    ``checkpoint_dir``, saving every ``checkpoint_every`` steps (both passed to the ranks as
    ``FAIRSCALE_CHECKPOINT_DIR`` / ``FAIRSCALE_CHECKPOINT_EVERY``; ``FAIRSCALE_RESTART_COUNT``
    counts the restarts).

    ``calibrate_steps``: every ``fairscale.parallelize`` in the script closes the loop over that
    many timed steps (``FAIRSCALE_CALIBRATE``; see ``fairscale.closed_loop``).
    """
    err = stderr or sys.stderr
    problem = _usage_problem(script, devices, max_restarts, checkpoint_every)
    if problem is None and calibrate_steps is not None and calibrate_steps < 1:
        problem = f"--calibrate-steps must be >= 1, got {calibrate_steps}"
    if problem:
        print(f"fairscale run: {problem}", file=err)
        return 2
    temporary = checkpoint_dir is None and (max_restarts > 0 or checkpoint_every is not None)
    if temporary:  # restarts of this job resume from it; a new `fairscale run` starts afresh
        checkpoint_dir = tempfile.mkdtemp(prefix="fairscale-run-")
    env = {ENV_DIR: str(Path(checkpoint_dir).resolve())} if checkpoint_dir is not None else {}
    if checkpoint_every is not None:
        env[ENV_EVERY] = str(checkpoint_every)
    if calibrate_steps is not None:
        env[ENV_CALIBRATE] = str(calibrate_steps)
    code = _run_with_restarts(script, devices, argv, env, timeout_s=timeout_s, max_restarts=max_restarts, err=err)
    if temporary and checkpoint_dir is not None:
        if code == 0:
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
        else:
            print(f"fairscale run: checkpoints kept in {checkpoint_dir}; resume with --checkpoint-dir "
                  f"{checkpoint_dir}", file=err)
    return code


def _run_with_restarts(script: str, devices: int, argv: Sequence[str], env: dict[str, str], *,
                       timeout_s: float | None, max_restarts: int, err: TextIO) -> int:
    for restart in range(max_restarts + 1):
        env = {**env, ENV_RESTART: str(restart)}
        try:
            launch(_run_rank, devices=devices, args=(script, list(argv), env), timeout_s=timeout_s)
            return 0
        except RankFailedError as exc:
            print(f"fairscale run: {exc}", file=err)
            left = devices - len(exc.lost)
            if restart == max_restarts or left < 1:
                why = "no device is left" if left < 1 else (
                    f"no restart is left (--max-restarts {max_restarts})" if max_restarts else
                    "give --max-restarts K to restart on the devices that are left")
                print(f"fairscale run: stopped: {why}", file=err)
                return 1
            lost = f"; lost rank{'s' * (len(exc.lost) > 1)} {', '.join(map(str, sorted(exc.lost)))}" if exc.lost else ""
            resumes = f"; resuming from the last checkpoint in {env[ENV_DIR]}" if ENV_DIR in env else ""
            print(f"fairscale run: restarting on {left} devices (restart {restart + 1} of {max_restarts}{lost}){resumes}",
                  file=err)
            devices = left
        except KeyboardInterrupt:
            print(f"fairscale run: interrupted; all {devices} ranks were stopped", file=err)
            return 130
    return 1  # not reached: the last start returns above


def _usage_problem(script: str, devices: int, max_restarts: int, checkpoint_every: int | None) -> str | None:
    if not Path(script).is_file():
        return f"no such script: {script}"
    if devices < 1:
        return f"--devices must be >= 1, got {devices}"
    if max_restarts < 0:
        return f"--max-restarts must be >= 0, got {max_restarts}"
    if checkpoint_every is not None and checkpoint_every < 1:
        return f"--checkpoint-every must be >= 1, got {checkpoint_every}"
    return None
