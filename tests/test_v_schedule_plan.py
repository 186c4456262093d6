"""The V-shaped pipeline schedule as a plan kind: validated, costed from its own timeline, searched,
and trained exactly on real gloo ranks (rank 0 holds the first and last chunk: GPT's tied
embedding and LM head share a rank)."""

from __future__ import annotations

import functools

import pytest
import torch

import fairscale
from fairscale.api import captured, parallelize
from fairscale.testing.models import build
from fairscale.testing.reference import Trajectory, compare, train_reference
from planner.cluster import Cluster
from planner.plan import DataParallel, Mesh, Plan, PlanError, Schedule, Stage
from planner.schedule import v_shape
from planner.schedule_cost import bubble_fraction, in_flight, pipeline_time, stage_placement
from planner.schedule_sim import simulate
from planner.search import cost_plan, search
from planner.validate import validate_plan

BATCH = 8
CLUSTER = Cluster.cpu(4, memory_bytes=16 * 2**30)
STAGES = ["wte, wpe, layers.0", "layers.1", "layers.2", "layers.3, ln_f, lm_head"]


def _build():
    case = build("gpt", layers=4)
    case.model.to(torch.float64)
    make = case.make_batch
    case.make_batch = lambda step, n: tuple(t.to(torch.float64) if t.is_floating_point() else t for t in make(step, n))
    return case


def _plan(**schedule) -> Plan:
    sched = dict(kind="v", microbatches=4, virtual_stages=2, global_batch=BATCH) | schedule
    return Plan(mesh=Mesh(pp=2, dp=2), schedule=Schedule(**sched), stages=[Stage(layers=s) for s in STAGES],
                data_parallel=DataParallel(kind="zero1"))


@pytest.fixture(scope="module")
def graph():
    case = _build()
    return captured(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn)


def test_closed_forms_match_the_simulated_timeline() -> None:
    for p, m in [(2, 4), (4, 8), (4, 16)]:
        sim = simulate(v_shape(p, m))
        assert bubble_fraction("v", p, m, v=2) == pytest.approx(sim.bubble)
        # balanced stages of 3 time units per rank (F 1 + B 2 per chunk, two chunks): the simulated makespan
        assert pipeline_time("v", [6.0] * p, m, v=2) == pytest.approx(sim.makespan)
    assert stage_placement("v", 4) == [0, 1, 2, 3, 3, 2, 1, 0]
    # peak chunk-microbatches alive, read off the action list: rank 0 holds about 1F1B's peak
    assert in_flight("v", 4, 8, 0, v=2) == 4.5


def test_validate_and_cost(graph) -> None:
    validate_plan(_plan(), graph, devices=4)
    with pytest.raises(PlanError, match='kind "v" places two chunks on each pipeline rank .* needs virtual_stages 2'):
        validate_plan(_plan(virtual_stages=1), graph, devices=4)
    b = cost_plan(_plan(), graph, CLUSTER)
    assert b.bubble > 0 and len(b.memory_bytes) == 2
    # the turn (stage 1 -> 2) stays on rank 1: only the two other boundaries send
    assert len(b.stage_f_s) == 4
    found = search(graph, CLUSTER, global_batch=BATCH, constraints={"schedule": {"kind": "v"}, "mesh": {"pp": 2}})
    assert found.best.plan.schedule.kind == "v" and found.best.plan.schedule.virtual_stages == 2
    validate_plan(found.best.plan, graph, devices=4)


def _train(rank: int, world: int, plan: Plan) -> Trajectory:
    case = _build()
    pm = parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=plan,
                     optimizer=functools.partial(torch.optim.Adam, lr=1e-3))
    losses = [pm.train_step(case.make_batch(step, BATCH)) for step in range(3)]
    return Trajectory(losses=losses, params=pm.state_dict())


def test_v_plan_trains_exactly() -> None:
    got = fairscale.launch(_train, devices=4, args=(_plan(),))[0]
    ref = train_reference(_build, steps=3, global_batch=BATCH, lr=1e-3)
    compare(ref, got, rtol=1e-10, atol=1e-9)
