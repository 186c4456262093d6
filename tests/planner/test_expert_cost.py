"""The cost model and the search under expert parallelism (mesh.ep), checked against hand arithmetic."""

from __future__ import annotations

import pytest

from fairscale.api import captured
from fairscale.testing.models import build
from planner.cluster import Cluster
from planner.cost_memory import model_state_bytes
from planner.plan import Mesh, Plan, PlanError, Schedule
from planner.search import cost_plan, search
from planner.validate import validate_plan

BATCH, LAYERS, EXPERTS = 8, 4, 8
CLUSTER = Cluster.cpu(4, memory_bytes=16 * 2**30)


@pytest.fixture(scope="module")
def graph():
    case = build("mixtral", layers=LAYERS, experts=EXPERTS)
    return captured(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn)


def _cost(graph, **mesh):
    plan = Plan(mesh=Mesh(**mesh), schedule=Schedule(global_batch=BATCH))
    return cost_plan(plan, graph, CLUSTER)


def test_expert_facts(graph) -> None:
    experts = graph.experts()
    assert len(experts) == LAYERS
    facts = experts["model.layers.0.mlp.experts"]
    assert facts.num_experts == EXPERTS
    assert facts.keys == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    rows = BATCH * 16 * 2  # tokens × top-2, each a 64-wide float32 row in and out
    assert facts.dispatch_bytes == facts.combine_bytes == rows * 64 * 4


def test_expert_parallel_memory_and_bytes(graph) -> None:
    base, split = _cost(graph, dp=4), _cost(graph, dp=4, ep=4)
    per_layer = EXPERTS * 3 * 128 * 64  # gate|up [E, 256, 64] + down [E, 64, 128]
    experts = LAYERS * per_layer
    # ddp keeps every state: the rank drops 3/4 of the experts' parameters, gradients and Adam moments
    saved = model_state_bytes(experts * 3 / 4, dp_kind="ddp", dp=4)
    assert base.memory_bytes[0] - split.memory_bytes[0] == pytest.approx(saved)
    # bytes: the experts leave the dp all-reduce (ep_rep has 1 rank), and per MoE layer the
    # dispatch + combine rows cross the ep group forward and backward
    rows = 2 * (BATCH // 4) * 16 * 2 * 64 * 4  # one rank's rows in and out, per layer
    a2a = LAYERS * 2 * rows * 3 / 4
    allreduce = 2 * 3 / 4 * experts * 4
    assert base.comm_bytes - split.comm_bytes == pytest.approx(allreduce - a2a)
    assert base.ep_comm_s == 0.0 and split.ep_comm_s > 0.0


def test_search_tries_expert_parallel_degrees(graph) -> None:
    cluster = CLUSTER
    fixed = search(graph, cluster, global_batch=BATCH, constraints={"mesh": {"dp": 4, "ep": 2}})
    assert fixed.best.plan.mesh.ep == 2
    validate_plan(fixed.best.plan, graph, devices=4)
    dense_case = build("gpt")
    dense = captured(dense_case.model, dense_case.make_batch(0, BATCH), loss_fn=dense_case.loss_fn)
    with pytest.raises(PlanError, match="mesh.ep: 2, but GPT has no mixture-of-experts layer"):
        search(dense, cluster, global_batch=BATCH, constraints={"mesh": {"dp": 4, "ep": 2}})
    assert search(dense, cluster, global_batch=BATCH).best.plan.mesh.ep == 1


def test_report_names_the_expert_axis() -> None:
    from fairscale.report.text import render_report

    two = render_report(Plan(mesh=Mesh(dp=4, ep=2)), None)
    assert "mesh: pp(1) × dp(4) × tp(1) = 4 devices; MoE experts split over ep(2) of the dp ranks" in two
    assert "expert gradients all-reduced over the 2 ranks holding the same experts" in two
    four = render_report(Plan(mesh=Mesh(dp=4, ep=4)), None)
    assert "each rank holds its own experts, so their gradients need no all-reduce" in four
    assert "ep(" not in render_report(Plan(mesh=Mesh(dp=4)), None)
