"""Elastic training: a loop that plans for the devices it has, checkpoints, and resumes under any plan.

Usage, in a script run on every rank (``python -m fairscale run --devices 8 --max-restarts 3
--checkpoint-every 100 train.py``, or ``torchrun ... train.py``)::

    import fairscale

    model = build_model(seed=0)                       # the same weights on every rank, every restart
    result = fairscale.train(model, lambda step: batch_of(step), steps=10_000, loss_fn=loss_fn)
    print(result.losses[-1], result.plan.mesh)

:func:`train` plans for the ranks it was launched on (the search may leave some idle when the batch
does not split over all of them: 7 ranks and a global batch of 8 train on 4), resumes from the
latest checkpoint in the checkpoint directory if there is one (written under any plan, on any number
of devices: ``fairscale.runtime.engine_checkpoint``), trains to ``steps``, and writes a checkpoint
every ``checkpoint_every`` steps and at the end. When a rank dies, ``fairscale run --max-restarts K``
starts the script again on the devices that are left (``torchrun``'s elastic restarts do the same
with the new world size), and the loop re-plans for them and continues from the last checkpoint.

The contract that makes a resumed run equal to an uninterrupted one: ``batches(step)`` returns the
same global batch for a step every time it is asked (a function of the step, not an iterator), every
rank builds the same model (same seed), and the random state of a step is ``torch.manual_seed(seed
+ step)``. Then the losses after a resume are those of a fresh run of the new plan from that
checkpoint (``tests/test_elastic.py`` checks it on 8 ranks with one killed).

Checkpoint directory layout: ``step-<N>/`` (a DCP checkpoint taken after N steps) and
``elastic.json`` (the last complete checkpoint, the losses so far, the plan and the model's
fingerprint), replaced atomically after the checkpoint it names is complete, so a kill at any
moment leaves a record that names a complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fairscale.api import parallelize, search
from fairscale.elastic_schedule import SCHEDULER, refuse_unkept_schedulers, resume_scheduler, save_scheduler
from fairscale.elastic_schedule import step_scheduler
from fairscale.elastic_world import regroup
from fairscale.runtime.engine import OptimizerSpec
from fairscale.runtime.launch import init_distributed, under_torchrun
from fairscale.runtime.run_cli import ENV_DIR, ENV_EVERY, ENV_RESTART
from fairscale.runtime.startup import broadcast_from_zero
from planner.plan import Plan

__all__ = ["train", "ElasticResult", "restart_count", "RECORD"]

RECORD = "elastic.json"
"""The file in the checkpoint directory naming the last complete checkpoint."""


def restart_count() -> int:
    """How many times this job was restarted: ``fairscale run --max-restarts``'s count, or
    torchrun's ``TORCHELASTIC_RESTART_COUNT``; 0 on the first start."""
    return int(os.environ.get(ENV_RESTART) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


@dataclasses.dataclass
class ElasticResult:
    """What :func:`train` did on this rank."""

    losses: list[float]
    """The loss of every step 0..steps-1 (those before ``resumed_from`` as recorded in the checkpoint)."""
    plan: Plan
    """The plan this start trained with."""
    launched: int
    """Ranks this start was launched on."""
    resumed_from: int | None = None
    """Steps done by the checkpoint this start resumed from; None when it started from scratch."""
    idle: bool = False
    """This rank had no part in the plan (it uses fewer devices than were launched) and returned at once."""

    @property
    def devices(self) -> int:
        """Devices the plan trains on (``plan.mesh.size``; at most ``launched``)."""
        return self.plan.mesh.size


def train(model: nn.Module, batches: Callable[[int], Sequence[Any]], *, steps: int,
          loss_fn: Callable[..., torch.Tensor] | None = None, example_inputs: Sequence[Any] | None = None,
          optimizer: OptimizerSpec | None = None, global_batch: int | None = None,
          constraints: dict[str, Any] | None = None, checkpoint_dir: str | os.PathLike[str] | None = None,
          checkpoint_every: int | None = None, keep_last: int | None = 2, seed: int = 0,
          clip_norm: float | None = None, on_step: Callable[[int, float], None] | None = None,
          lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None) -> ElasticResult:
    """Plan for the launched ranks, resume from the last checkpoint, train to ``steps``. Every rank calls it.

    Args:
        model: the initialized model, the same on every rank and at every restart (same seed).
        batches: ``batches(step)`` -> the global batch of that step (a tuple, or a dict of the
            inputs by name for a model that returns its loss), the same on every rank and every
            time it is asked for the same step.
        steps: optimizer steps in the whole run (counting those done before a restart).
        loss_fn, optimizer: as :func:`fairscale.parallelize`.
        example_inputs: the batch to capture with (default ``batches(0)``).
        global_batch: samples per step (default: the example batch's size).
        constraints: fields every plan must keep (``{"mesh": {"tp": 2}}``), as :func:`fairscale.search`.
        checkpoint_dir: where checkpoints go and are resumed from (default ``$FAIRSCALE_CHECKPOINT_DIR``,
            which ``fairscale run --checkpoint-dir`` sets); None: no checkpoints, no resume.
        checkpoint_every: save after every this many steps, and after the last (default
            ``$FAIRSCALE_CHECKPOINT_EVERY``; None: only after the last step).
        keep_last: how many checkpoints to keep (the oldest are deleted); None keeps all.
        seed: step ``s`` runs after ``torch.manual_seed(seed + s)`` (dropout and other random ops
            repeat exactly on a resume).
        clip_norm: passed to ``pm.train_step``.
        on_step: ``on_step(step, loss)`` after every step (and its checkpoint, if one was due), on every
            training rank; ``on_step(step, loss, pm)`` if it takes a third argument, the rank's
            :class:`~fairscale.runtime.engine.ParallelModule`: to evaluate mid-run, call
            ``pm.evaluate(batch)``, or ``pm.gather_into(model)`` (every rank) before running ``model``,
            which is behind its ranks until then.
        lr_scheduler: ``lr_scheduler(optimizer)`` -> a ``torch.optim.lr_scheduler`` scheduler, built on
            ``pm.optimizer`` and stepped after every optimizer step (``ReduceLROnPlateau`` with the
            step's loss); checkpoints keep its state, so a resumed run follows the schedule exactly.
            A scheduler attached to ``pm.optimizer`` otherwise (in ``on_step``) is refused after the
            first step when checkpoints are written: they could not keep it.

    Returns:
        :class:`ElasticResult`; on a rank the plan leaves idle, ``idle=True`` and no losses. On every
        rank that trained, ``model`` then holds the trained weights (``pm.gather_into``).
    """
    if not dist.is_initialized() and under_torchrun():
        init_distributed(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), init_method="env://")
    if not dist.is_initialized():
        raise RuntimeError("fairscale.train runs on every rank: run the script with `python -m fairscale run "
                           "--devices N script.py`, under torchrun, or call it inside fairscale.launch(fn, devices=N)")
    if not callable(batches):
        raise TypeError(f"batches must be a function step -> global batch (a tuple), got {type(batches).__name__}; "
                        "a function of the step is what lets a restarted run see the same data")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    directory = _directory(checkpoint_dir)
    every = _every(checkpoint_every)
    if every is not None and directory is None:
        raise ValueError(f"checkpoint_every={every} needs a checkpoint_dir to write to (or run the script with "
                         "`fairscale run --checkpoint-every S`, which gives one)")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 (or None: keep every checkpoint), got {keep_last}")
    example = _form(example_inputs if example_inputs is not None else batches(0))
    launched = dist.get_world_size()
    plan, record = _plan_and_record(model, example, loss_fn=loss_fn, global_batch=global_batch,
                                    constraints=constraints, directory=directory, launched=launched)
    if plan.mesh.size < launched and not regroup(plan.mesh.size):
        return ElasticResult(losses=[], plan=plan, launched=launched, idle=True)
    pm = parallelize(model, example_inputs=example, loss_fn=loss_fn, plan=plan, optimizer=optimizer,
                     global_batch=global_batch)
    losses: list[float] = []
    resumed: int | None = None
    sched = lr_scheduler(pm.optimizer) if lr_scheduler is not None else None  # before the checkpoint's rates
    if record is not None:
        assert directory is not None  # a record is only read from a directory
        pm.load_checkpoint(str(directory / record["checkpoint"]))
        resume_scheduler(sched, record.get(SCHEDULER), directory / record["checkpoint"])
        resumed = int(record["step"])
        losses = [float(x) for x in record["losses"]][:resumed]
    with_pm = on_step is not None and _positional(on_step) >= 3
    for step in range(resumed or 0, steps):
        torch.manual_seed(seed + step)
        losses.append(float(pm.train_step(_form(batches(step)), clip_norm=clip_norm)))
        step_scheduler(sched, losses[-1])
        done = step + 1
        if directory is not None and ((every and done % every == 0) or done == steps):
            _save(pm, directory, done, losses, plan=plan, keep_last=keep_last, sched=sched)
        if on_step is not None:
            on_step(step, losses[-1], pm) if with_pm else on_step(step, losses[-1])
        if directory is not None and step == (resumed or 0):
            refuse_unkept_schedulers(pm.optimizer, sched)
    pm.gather_into(model)  # the caller's model holds the trained weights (fairscale.runtime.model_guard)
    return ElasticResult(losses=losses, plan=plan, launched=launched, resumed_from=resumed)


def _positional(fn: Callable[..., Any]) -> int:
    """How many positional arguments ``fn`` takes (a large number for ``*args``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the documented two
        return 2
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 1 << 30
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _directory(checkpoint_dir: str | os.PathLike[str] | None) -> Path | None:
    value = checkpoint_dir if checkpoint_dir is not None else os.environ.get(ENV_DIR)
    return Path(value) if value else None


def _every(checkpoint_every: int | None) -> int | None:
    value: Any = checkpoint_every if checkpoint_every is not None else os.environ.get(ENV_EVERY)
    if value is None or value == "":
        return None
    every = int(value)
    if every < 1:
        raise ValueError(f"checkpoint_every must be at least 1 (or None: only after the last step), got {every}")
    return every


def _form(batch: Any) -> Any:
    """A batch as ``parallelize`` and ``train_step`` take it: a dict by name as it is, else a tuple."""
    return batch if isinstance(batch, Mapping) else tuple(batch)


def _plan_and_record(model: nn.Module, example: Any, *, loss_fn: Any, global_batch: int | None,
                     constraints: dict[str, Any] | None, directory: Path | None,
                     launched: int) -> tuple[Plan, dict[str, Any] | None]:
    """Global rank 0 searches a plan for the launched ranks (which may use fewer) and reads the
    checkpoint record; every rank gets both. One search instead of one per rank, and one answer."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            plan = search(model, example, devices=launched, loss_fn=loss_fn, global_batch=global_batch,
                          constraints=constraints).plan
            box = [("ok", plan.to_json(), _read_record(directory, plan.model.fingerprint))]
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, then rank 0 raises it
            box = [("error", f"{type(exc).__name__}: {exc}", None)]
            broadcast_from_zero(box, "planning the run")
            raise
    broadcast_from_zero(box, "planning the run")
    status, text, record = box[0]
    if status != "ok":
        raise RuntimeError(f"global rank 0 could not plan the run, so this rank stops too: {text}")
    return Plan.from_json(text, source="the plan global rank 0 searched"), record


def _read_record(directory: Path | None, fingerprint: str | None) -> dict[str, Any] | None:
    """The checkpoint record of ``directory`` (None if it has none); refused if it belongs to another model."""
    if directory is None or not (directory / RECORD).is_file():
        return None
    record: dict[str, Any] = json.loads((directory / RECORD).read_text())
    if fingerprint is not None and record.get("fingerprint") not in (None, fingerprint):
        raise ValueError(f"{directory / RECORD} records checkpoints of another model (fingerprint "
                         f"{record.get('fingerprint')}, this one is {fingerprint}); give another checkpoint "
                         "directory, or delete this one to start from scratch")
    return record


def _save(pm: Any, directory: Path, done: int, losses: list[float], *, plan: Plan, keep_last: int | None,
          sched: Any = None) -> None:
    """Checkpoint after ``done`` steps (collective), then point the record at it and prune (rank 0)."""
    name = f"step-{done:06d}"
    pm.save_checkpoint(str(directory / name))
    if dist.get_rank() != 0:
        return
    record = {"step": done, "checkpoint": name, "losses": losses, "fingerprint": plan.model.fingerprint,
              "devices": plan.mesh.size, "plan": json.loads(plan.to_json()),
              SCHEDULER: save_scheduler(sched, directory / name)}
    tmp = directory / (RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, directory / RECORD)  # atomic: the record always names a complete checkpoint
    if keep_last is None:
        return
    kept = sorted(p for p in directory.glob("step-*") if p.is_dir() and p.name[5:].isdigit())
    for old in kept[:-keep_last]:
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
