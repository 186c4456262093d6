"""``fairscale.train``'s learning-rate scheduler: built on ``pm.optimizer``, stepped, kept in checkpoints.

A resumed run gets the optimizer's rates back from the checkpoint (its groups' options), but a
scheduler's own state (its step count, ``base_lrs``, a plateau's best loss) lives in the scheduler.
Without it, a run resumed after a restart started its schedule again from step 0 (a warmup
replayed, a cosine restarted), and its losses left those of the uninterrupted run, silently. The
state is saved beside each checkpoint (``lr_scheduler.pt``, named in the record) and loaded after
the checkpoint on resume; a scheduler the loop does not own, which no checkpoint can keep, is
refused after the first step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fairscale.runtime.user_optimizer import schedulers_of

__all__ = ["SCHEDULER", "save_scheduler", "resume_scheduler", "step_scheduler", "refuse_unkept_schedulers"]

SCHEDULER = "lr_scheduler"
"""The record's key: the scheduler's class name, or None for a run without one."""
_FILE = "lr_scheduler.pt"


def step_scheduler(sched: Any, loss: float) -> None:
    """One scheduler step after an optimizer step (``ReduceLROnPlateau`` on the step's loss)."""
    if sched is None:
        return
    if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
        sched.step(loss)
    else:
        sched.step()


def save_scheduler(sched: Any, checkpoint: Path) -> str | None:
    """Write ``sched``'s state beside the checkpoint (rank 0); its class name for the record."""
    if sched is None:
        return None
    torch.save(sched.state_dict(), checkpoint / _FILE)
    return type(sched).__name__


def resume_scheduler(sched: Any, saved: str | None, checkpoint: Path) -> None:
    """Load the state saved with ``checkpoint`` into ``sched``; refuse a run whose scheduler differs."""
    mine = type(sched).__name__ if sched is not None else None
    if mine != saved:
        raise ValueError(
            f"{checkpoint} was written by a run " + (f"with lr_scheduler {saved}" if saved else "without an lr_scheduler")
            + ", and this run has " + (f"lr_scheduler {mine}" if mine else "none") + ": resuming would not follow "
            "the schedule of the run it continues. Pass the same lr_scheduler= as that run, or start from scratch "
            "in another checkpoint directory")
    if sched is not None:
        sched.load_state_dict(torch.load(checkpoint / _FILE, weights_only=False))


def refuse_unkept_schedulers(optimizer: torch.optim.Optimizer, sched: Any) -> None:
    """Raise if a scheduler other than ``sched`` (or its parts) drives ``optimizer``: checkpoints would lose it."""
    ours = {id(sched)} | {id(s) for s in getattr(sched, "_schedulers", [])}
    others = [s for s in schedulers_of(optimizer) if id(s) not in ours]
    if others:
        kind = type(others[0]).__name__
        raise ValueError(
            f"fairscale.train: a learning-rate scheduler ({kind}) drives pm.optimizer, and this run writes "
            "checkpoints, which keep the optimizer's rates but not the scheduler's own state: a resumed run would "
            f"start the schedule again from step 0. Give it to fairscale.train, which steps it after every optimizer "
            f"step and checkpoints it: fairscale.train(..., lr_scheduler=lambda optimizer: {kind}(optimizer, ...))")
