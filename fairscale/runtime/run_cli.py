"""``python -m fairscale run --devices N script.py [args...]``: run a script on N CPU ranks.

Each rank is a forked process with ``torch.distributed`` initialized (gloo) and ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` set, as torchrun would; the script runs as ``__main__`` with
``sys.argv = [script, *args]``. Scripts written for torchrun work unchanged, and so do scripts
that call ``fairscale.launch(fn, devices=...)``: inside a launched rank it runs ``fn`` once on
that rank. If any rank fails the others are stopped and every failed rank's traceback is printed.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Sequence, TextIO

from fairscale.runtime.launch import RankFailedError, launch

__all__ = ["run_script"]


class ScriptExit(RuntimeError):
    """The script called ``sys.exit`` with a non-zero status on a rank."""


def _run_rank(rank: int, world: int, script: str, argv: list[str]) -> None:
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise ScriptExit(f"{script} exited with status {exc.code} on rank {rank}") from None
    return None


def run_script(script: str, devices: int, argv: Sequence[str] = (), *, timeout_s: float | None = None,
               stderr: TextIO | None = None) -> int:
    """Run ``script`` on ``devices`` forked ranks; return the process exit status (0 = every rank
    succeeded, 1 = a rank failed, 130 = interrupted with Ctrl-C; SIGTERM exits 143). No wall-clock
    limit unless ``timeout_s``; every rank is stopped on any way out."""
    err = stderr or sys.stderr
    if not Path(script).is_file():
        print(f"fairscale run: no such script: {script}", file=err)
        return 2
    if devices < 1:
        print(f"fairscale run: --devices must be >= 1, got {devices}", file=err)
        return 2
    try:
        launch(_run_rank, devices=devices, args=(script, list(argv)), timeout_s=timeout_s)
    except RankFailedError as exc:
        print(f"fairscale run: {exc}", file=err)
        return 1
    except KeyboardInterrupt:
        print(f"fairscale run: interrupted; all {devices} ranks were stopped", file=err)
        return 130
    return 0
