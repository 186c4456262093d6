"""fairscale.switch_plan: train under one plan, reshard the live training state to another in memory,
and continue exactly as one process would (float64, Adam, a GPT with a tied embedding)."""

from __future__ import annotations

import functools

import pytest
import torch

import fairscale
from fairscale.testing.models import build
from fairscale.testing.plans import even_plan
from fairscale.testing.reference import Trajectory, compare, train_reference
from planner.plan import Plan

BATCH, LR, STEPS = 8, 1e-3, 2  # STEPS optimizer steps under each plan


def _case():
    case = build("gpt")
    case.model.double()
    return case


@functools.lru_cache(maxsize=None)
def _shared():
    """One model for every plan, built in the test process: the ranks inherit it and the plan-time
    compile check's captures (``_plan`` checks each plan, as ``fairscale.search`` does before a
    launch); ``parallelize`` and ``switch_plan`` never change the model, so every run starts from
    its weights."""
    return _case()


def _plan(pp: int, dp: int, tp: int, kind: str = "ddp", microbatches: int = 1, schedule: str = "1f1b") -> Plan:
    return even_plan(_shared(), BATCH, pp, dp, tp, kind, microbatches=microbatches, schedule=schedule)


def _live_groups() -> int:
    return len(torch.distributed.distributed_c10d._world.pg_map)


def _chain(rank: int, world: int, plans: list[Plan]) -> Trajectory:
    case = _shared()
    groups = _live_groups()
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                               plan=plans[0], optimizer=functools.partial(torch.optim.Adam, lr=LR))
    losses: list[float] = []
    for i, plan in enumerate(plans):
        if i:
            old, pm = pm, fairscale.switch_plan(pm, plan)
            with pytest.raises(RuntimeError, match="was switched to another plan; use the module"):
                old.train_step(case.make_batch(0, BATCH))
        assert (pm.plan.mesh.pp, pm.plan.mesh.dp, pm.plan.mesh.tp) == (plan.mesh.pp, plan.mesh.dp, plan.mesh.tp)
        losses += [pm.train_step(case.make_batch(step, BATCH)) for step in range(i * STEPS, (i + 1) * STEPS)]
    got = Trajectory(losses=losses, params=pm.state_dict())
    # a switched-from module released its mesh's process groups (their gloo threads would tax every
    # later step), and so does a closed one: the process is back to the groups it had
    assert _live_groups() > groups
    pm.close()
    pm.close()  # idempotent
    assert _live_groups() == groups
    with pytest.raises(RuntimeError, match=r"was closed \(pm.close\(\)\)"):
        pm.train_step(case.make_batch(0, BATCH))
    return got


CHAINS = {
    # the tied wte/lm_head lives on stages 0 and 3 under pp4, once under dp: its Adam state must follow
    "pp4-dp4-dp2xtp2zero1": lambda: [_plan(4, 1, 1, microbatches=2, schedule="gpipe"), _plan(1, 4, 1), _plan(1, 2, 2, "zero1")],
    "dp2xtp2fsdp-pp2xtp2-pp4": lambda: [_plan(1, 2, 2, "fsdp"), _plan(2, 1, 2, microbatches=2),
                                        _plan(4, 1, 1, microbatches=4)],
}


@pytest.mark.parametrize("chain", list(CHAINS))
def test_switch_plan_continues_exactly(chain):
    plans = CHAINS[chain]()
    reference = train_reference(_case, steps=STEPS * len(plans), global_batch=BATCH, lr=LR)
    got = fairscale.launch(_chain, devices=4, args=(plans,))[0]
    compare(reference, got, rtol=1e-10, atol=1e-9)


def _refused(rank: int, world: int, first: Plan, second: Plan) -> str:
    case = _shared()
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                               plan=first)
    try:
        fairscale.switch_plan(pm, second)
    except ValueError as exc:
        pm.train_step(case.make_batch(0, BATCH))  # refused before any state moved: the old module still runs
        return str(exc)
    return "not refused"


def test_switch_plan_keeps_the_global_batch():
    other = _plan(1, 4, 1)
    other.schedule.global_batch = 2 * BATCH
    msg = fairscale.launch(_refused, devices=4, args=(_plan(1, 4, 1), other))[0]
    assert "the new plan's global batch is 16, but this run trains on 8 samples per step" in msg
