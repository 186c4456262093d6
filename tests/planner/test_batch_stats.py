"""Batch statistics at plan time: which ops are found, what validation and the search refuse, and
the plan field ``batch_norm`` ("sync" exact by default, "local" opt-in) through JSON and the report."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.report.text import render_report
from fairscale.testing.batch_norm_models import build_resnet, build_tabular
from fairscale.testing.models import build
from planner.batch_stats import find_batch_stat_ops
from planner.capture import capture
from planner.plan import Mesh, Plan, PlanError, Schedule
from planner.validate import validate_plan

RESNET_BNS = ["bn1", "layer1.bn1", "layer1.bn2", "layer2.bn1", "layer2.bn2", "layer2.downsample.1"]


def _graph(case, batch: int = 8, **kwargs):
    return capture(case.model, case.make_batch(0, batch), loss_fn=case.loss_fn, **kwargs)


@functools.lru_cache(maxsize=None)
def _resnet():
    return _graph(build_resnet())


class _Wrap(nn.Module):
    """A norm layer between two linears, or a functional batch norm without buffers."""

    def __init__(self, norm: nn.Module | None) -> None:
        super().__init__()
        self.inp, self.norm, self.out = nn.Conv2d(3, 4, 1), norm, nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.norm(h) if self.norm is not None else F.batch_norm(h, None, None, training=True)
        return self.out(h.mean((2, 3)))


def _found(norm: nn.Module | None, *, tracer: str = "auto"):
    model = _Wrap(norm)
    graph = capture(model, (torch.randn(4, 3, 5, 5), torch.randint(0, 2, (4,))), loss_fn=F.cross_entropy,
                    tracer=tracer, annotate=tracer != "fx")
    return find_batch_stat_ops(graph.gm)


def test_finds_every_batch_norm_of_a_resnet_with_its_source_line():
    ops = find_batch_stat_ops(_resnet().gm)
    assert [op.module for op in ops] == RESNET_BNS
    assert {op.what for op in ops} == {"BatchNorm2d"}
    assert all(op.supported and op.kind == "batch_norm" and op.op == "aten.batch_norm.default" for op in ops)
    assert ops[0].source == "batch_norm_models.py:62 `x = self.relu(self.bn1(self.conv1(x)))`"
    assert [op.per_sample for op in ops] == [64, 64, 64, 16, 16, 16]


@pytest.mark.parametrize("norm,what", [
    (nn.BatchNorm2d(4), "BatchNorm2d"),
    (nn.BatchNorm2d(4, affine=False), "BatchNorm2d"),
    (nn.BatchNorm2d(4, track_running_stats=False).eval(), "BatchNorm2d"),  # batch statistics even in eval
    (nn.SyncBatchNorm(4), "SyncBatchNorm"),
    (None, "aten.batch_norm"),  # F.batch_norm(h, None, None, training=True) in the model's own forward
    (nn.InstanceNorm2d(4, track_running_stats=True), "InstanceNorm2d running statistics"),
])
def test_found_forms(norm, what):
    ops = _found(norm)
    assert [op.what for op in ops] == [what]
    assert ops[0].source.startswith("test_batch_stats.py:")


@pytest.mark.parametrize("norm", [nn.BatchNorm2d(4).eval(), nn.InstanceNorm2d(4, affine=True),
                                  nn.InstanceNorm2d(4, track_running_stats=True).eval(), nn.GroupNorm(2, 4)],
                         ids=["bn-eval", "instance-norm", "instance-norm-eval", "group-norm"])
def test_per_sample_and_eval_norms_are_not_batch_statistics(norm):
    assert _found(norm) == []


def test_fx_keeps_norm_modules_whole_and_they_are_found():
    ops = _found(nn.BatchNorm2d(4, momentum=None), tracer="fx")
    assert [(op.module, op.what, op.op) for op in ops] == [("norm", "BatchNorm2d", "call_module")]
    assert _found(nn.BatchNorm2d(4).eval(), tracer="fx") == []


def _problems(plan: Plan, graph, devices: int) -> list[str]:
    with pytest.raises(PlanError) as info:
        validate_plan(plan, graph, devices=devices)
    return info.value.problems


def test_validation_refuses_microbatches_naming_the_batch_norms():
    plan = Plan(mesh=Mesh(dp=2), schedule=Schedule(kind="gpipe", microbatches=2, global_batch=8))
    (problem,) = _problems(plan, _resnet(), 2)
    assert problem.startswith(
        "schedule.microbatches: 2 microbatches per step would give each microbatch its own batch statistics, but "
        "the model has training-mode BatchNorm: bn1 (BatchNorm2d, batch_norm_models.py:62 `x = self.relu(self.bn1("
        "self.conv1(x)))`), layer1.bn1 (BatchNorm2d, batch_norm_models.py:39 `out = self.relu(self.bn1("
        "self.conv1(x)))`),")
    assert ("and 2 more. One process computes their statistics (op aten.batch_norm.default in each module) over the "
            "whole batch, which no pipeline can") in problem
    assert problem.endswith('Use "microbatches": 1 (with pp > 1, schedule kind "gpipe"), or opt in to '
                            'per-microbatch statistics with "batch_norm": "local" (each dp rank and microbatch '
                            "normalizes with its own statistics and updates the running statistics once per "
                            "microbatch, as torch DDP without SyncBatchNorm does)")


def test_validation_accepts_the_opt_in_and_single_microbatches():
    graph = _resnet()
    validate_plan(Plan(mesh=Mesh(dp=2), schedule=Schedule(microbatches=2, global_batch=8), batch_norm="local"),
                  graph, devices=2)
    validate_plan(Plan(mesh=Mesh(dp=4), schedule=Schedule(microbatches=1, global_batch=8)), graph, devices=4)
    gpt = capture(build("mlp").model, build("mlp").make_batch(0, 8), loss_fn=build("mlp").loss_fn)
    validate_plan(Plan(mesh=Mesh(dp=2), schedule=Schedule(microbatches=4, global_batch=8)), gpt, devices=2)


def test_validation_names_an_unknown_mode():
    assert _problems(Plan(batch_norm="synced"), None, 1) == [
        'batch_norm: unknown batch-norm mode "synced"; did you mean "sync"? (allowed: "sync", "local")']


def test_validation_refuses_one_sample_per_rank_for_batch_norm_1d():
    case = build_tabular()
    graph = _graph(case)
    (problem,) = _problems(Plan(mesh=Mesh(dp=8), schedule=Schedule(global_batch=8)), graph, 8)
    assert problem.startswith("schedule.global_batch: each dp rank's microbatch holds 1 sample (global batch / "
                              "(dp(8) × microbatches(1))), but layers.0.1 (BatchNorm1d, ")
    assert problem.endswith("torch's batch norm refuses a single value per channel in training (the runtime traces "
                            "the model at that shape). Use a global batch of at least 16, or fewer dp ranks or "
                            "microbatches")
    validate_plan(Plan(mesh=Mesh(dp=8), schedule=Schedule(global_batch=8)), _resnet(), devices=8)  # 64 values


def test_search_keeps_one_microbatch_unless_the_constraints_opt_in():
    case = build_resnet()
    result = fairscale.search(case.model, case.make_batch(0, 8), devices=4, loss_fn=case.loss_fn, top_k=3)
    plans = [result.plan] + [c.plan for c in result.runners_up]
    assert [p.schedule.microbatches for p in plans] == [1] * len(plans) and all(p.batch_norm == "sync" for p in plans)
    with pytest.raises(PlanError, match=r"schedule\.microbatches: 2 microbatches per step would give each "
                                        r"microbatch its own batch statistics"):
        fairscale.search(case.model, case.make_batch(0, 8), devices=4, loss_fn=case.loss_fn,
                         constraints={"microbatches": 2})
    local = fairscale.search(case.model, case.make_batch(0, 8), devices=4, loss_fn=case.loss_fn,
                             constraints={"microbatches": 2, "batch_norm": "local"}).plan
    assert (local.schedule.microbatches, local.batch_norm) == (2, "local")


def test_search_skips_meshes_with_one_sample_per_rank_for_batch_norm_1d():
    case = build_tabular()
    result = fairscale.search(case.model, case.make_batch(0, 8), devices=8, loss_fn=case.loss_fn, top_k=8)
    for plan in [result.plan] + [c.plan for c in result.runners_up]:
        assert 8 // (plan.mesh.dp * plan.schedule.microbatches) >= 2, plan.mesh


def test_plan_field_round_trips_and_is_type_checked():
    plan = Plan(batch_norm="local")
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_dict({"version": 1}).batch_norm == "sync"
    with pytest.raises(PlanError, match=r"batch_norm: expected a string, got true"):
        Plan.from_dict({"version": 1, "batch_norm": True})


def test_report_states_the_batch_norm_mode():
    graph = _resnet()
    assert ("batch norm: sync: statistics over the dp group's global batch, as one process computes them: bn1 "
            "(BatchNorm2d, ") in render_report(Plan(mesh=Mesh(dp=2)), graph)
    local = render_report(Plan(mesh=Mesh(dp=2), batch_norm="local"), graph)
    assert ("batch norm: local (opted in): each dp rank and microbatch normalizes with its own batch statistics and "
            "updates the running statistics once per microbatch, like torch DDP without SyncBatchNorm; losses and "
            "running statistics differ from one process's: bn1 (BatchNorm2d, ") in local
    gpt = build("mlp")
    assert "batch norm" not in render_report(Plan(), capture(gpt.model, gpt.make_batch(0, 8), loss_fn=gpt.loss_fn))
