"""Save under one 3-D plan, resume under another: training continues as if never interrupted."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

import fairscale
from fairscale.testing.models import build
from fairscale.testing.plans import even_plan
from fairscale.testing.reference import Trajectory, compare, train_reference
from planner.plan import Plan

BATCH, LR = 8, 1e-3


def _case():
    case = build("gpt")
    case.model.double()
    return case


@functools.lru_cache(maxsize=None)
def _shared():
    """One model for every plan, built in the test process: the ranks inherit it and the plan-time
    compile check's captures (``_plan`` checks each plan, as ``fairscale.search`` does before a
    launch); ``parallelize`` never changes the model, so every run starts from its weights."""
    return _case()


def _plan(pp: int, dp: int, tp: int, kind: str) -> Plan:
    return even_plan(_shared(), BATCH, pp, dp, tp, kind, microbatches=BATCH // dp)


def _run(rank: int, world: int, plan: Plan, steps: range, path: str, mode: str) -> Trajectory:
    case = _shared()
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=plan,
                               optimizer=functools.partial(torch.optim.Adam, lr=LR))
    if mode == "resume":
        pm.load_checkpoint(path)
    losses = [pm.train_step(case.make_batch(step, BATCH)) for step in steps]
    if mode == "save":
        pm.save_checkpoint(path)
    return Trajectory(losses=losses, params=pm.state_dict())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "step2")
    reference = train_reference(_case, steps=4, global_batch=BATCH, lr=LR)
    first = fairscale.launch(_run, devices=8, args=(_plan(2, 2, 2, "zero1"), range(2), path, "save"))[0]
    return path, reference, first


@pytest.mark.parametrize("mesh", [(1, 4, 2, "fsdp"), (8, 1, 1, "ddp")], ids=["1x4x2-fsdp", "8x1x1-ddp"])
def test_resume_under_another_plan_continues_exactly(saved, mesh):
    path, reference, first = saved
    assert first.losses == pytest.approx(reference.losses[:2], rel=1e-10)
    second = fairscale.launch(_run, devices=8, args=(_plan(*mesh), range(2, 4), path, "resume"))[0]
    compare(reference, Trajectory(losses=first.losses + second.losses, params=second.params), rtol=1e-10, atol=1e-9)


def _crash_while_saving(rank: int, world: int, plan: Plan, path: str) -> None:
    import torch.distributed.checkpoint as dcp  # what fairscale.runtime.engine_checkpoint.save calls

    case = _shared()
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=plan,
                               optimizer=functools.partial(torch.optim.Adam, lr=LR))
    pm.train_step(case.make_batch(0, BATCH))
    real_save = dcp.save

    def dying_save(state, **kwargs):
        if rank == 3:
            os._exit(9)  # the machine goes away in the middle of the save
        return real_save(state, **kwargs)

    dcp.save = dying_save
    pm.save_checkpoint(path)


def test_a_crash_mid_save_keeps_the_previous_checkpoint(saved):
    path, reference, _ = saved
    with pytest.raises(fairscale.RankFailedError, match="rank 3 failed first"):
        fairscale.launch(_crash_while_saving, devices=8, args=(_plan(2, 2, 2, "ddp"), path), grace_s=10)
    assert (Path(path) / ".metadata").exists()
    resumed = fairscale.launch(_run, devices=8, args=(_plan(1, 8, 1, "ddp"), range(2, 3), path, "resume"))[0]
    assert resumed.losses == pytest.approx(reference.losses[2:3], rel=1e-10)
