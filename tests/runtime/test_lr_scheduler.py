"""Learning-rate schedulers on ``pm.optimizer``, as training scripts attach them.

``torch.optim.lr_scheduler.*(pm.optimizer, ...)`` raised ``TypeError: _StageOptimizers is not an
Optimizer``: every script with a scheduler crashed after launch. ``pm.optimizer`` is now a
``torch.optim.Optimizer`` over the stage optimizers' own groups
(:mod:`fairscale.runtime.stage_optimizers`), and it stays the same object through a live plan
switch, so the scheduler keeps driving the new plan (OneCycleLR also keeps its ``max_lr`` /
``min_lr`` group keys through the reshard).
"""

from __future__ import annotations

import functools

import pytest
import torch

import fairscale
from fairscale.api import captured
from fairscale.testing.models import build
from planner.plan import Mesh, Plan, Schedule, Stage

BATCH, STEPS, SWITCH_AT = 8, 4, 2


def _case():
    case = build("gpt")
    case.model.double()
    return case


def _scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    # cycle_momentum walks Adam's betas: the scheduler reads optimizer.defaults and writes two group keys
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=STEPS + 1, pct_start=0.5)


def _plan(pp: int, dp: int, microbatches: int = 1, virtual: int = 1) -> Plan:
    case = _case()
    names = [layer.name for layer in captured(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn).layers]
    n = pp * virtual
    cuts = [len(names) * i // n for i in range(n + 1)]
    stages = [Stage(layers=", ".join(names[a:b])) for a, b in zip(cuts, cuts[1:])] if pp > 1 else []
    kind = "interleaved" if virtual > 1 else "1f1b"
    return Plan(mesh=Mesh(pp=pp, dp=dp), stages=stages,
                schedule=Schedule(kind=kind, microbatches=microbatches, virtual_stages=virtual, global_batch=BATCH))


def _one_process() -> list[float]:
    case = _case()
    opt = torch.optim.Adam(case.model.parameters(), lr=1e-3)
    sched = _scheduler(opt)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        batch = case.make_batch(step, BATCH)
        loss = case.loss_fn(case.model(batch[0]), *batch[1:])
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def _rank(rank: int, world: int, plans: list[Plan]) -> tuple[list[float], list[float]]:
    case = _case()
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                               plan=plans[0], optimizer=functools.partial(torch.optim.Adam, lr=1e-3))
    assert isinstance(pm.optimizer, torch.optim.Optimizer)
    with pytest.raises(TypeError, match="add_param_group is not supported"):
        pm.optimizer.add_param_group({"params": []})
    sched = _scheduler(pm.optimizer)
    losses, lrs = [], []
    for step in range(STEPS):
        if step == SWITCH_AT and len(plans) > 1:
            held = pm.optimizer
            pm = fairscale.switch_plan(pm, plans[1])
            assert pm.optimizer is held and sched.optimizer is held
        losses.append(pm.train_step(case.make_batch(step, BATCH)))
        sched.step()
        lrs.append(pm.optimizer.param_groups[0]["lr"])
    groups = pm.optimizer.param_groups
    assert len(groups) == 1  # as in one process, however many stages this rank runs
    assert {g["lr"] for o in pm.optimizer.optimizers for g in o.param_groups} == {lrs[-1]}
    return losses, lrs


@pytest.mark.parametrize("plans", [
    # each rank steps two stage optimizers (two virtual stages): one scheduler sets both
    pytest.param(lambda: [_plan(2, 1, microbatches=2, virtual=2)], id="pp2-interleaved"),
    pytest.param(lambda: [_plan(1, 2), _plan(2, 1, microbatches=2)], id="dp2-switch-pp2"),
])
def test_a_scheduler_on_pm_optimizer_trains_as_one_process(plans) -> None:
    chosen = plans()
    world = chosen[0].mesh.pp * chosen[0].mesh.dp
    losses, lrs = fairscale.launch(_rank, devices=world, args=(chosen,))[0]
    want = _one_process()
    assert len(set(lrs)) == len(lrs), lrs  # the schedule really moved the rate every step
    for got, ref in zip(losses, want):
        assert abs(got - ref) <= 1e-10 * abs(ref), (losses, want)
