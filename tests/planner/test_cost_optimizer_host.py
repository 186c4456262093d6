"""The optimizer's host cost per parameter tensor (Cluster.optimizer_tensor_s): counted per tensor
the rank's optimizer updates (DDP: every parameter tensor; ZeRO: one shard per bucket; FSDP: one
per unit), and fitted by calibration as a slope."""

import dataclasses

import pytest

from fairscale.runtime.calibrate import fit_slope
from planner.cluster import Cluster
from planner.cost import layer_facts
from planner.cost_gpt import gpt_graph
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage
from planner.search import cost_plan


def _plan(dp_kind: str) -> Plan:
    return Plan(mesh=Mesh(pp=1, dp=8, tp=1), stages=[Stage(layers="*")],
                schedule=Schedule(kind="1f1b", microbatches=1), data_parallel=DataParallel(kind=dp_kind))


def test_layer_facts_count_each_parameter_tensor_once():
    g = gpt_graph(layers=2, hidden=64, heads=4, seq=32, vocab=256)
    facts = layer_facts(g, {})
    # 2 embeddings + 2 blocks × 16 (4 attention and 2 MLP linears with bias, 2 norms) + ln_f's 2;
    # the tied head weight is the embedding's (param_shapes lists it under both names): counted once
    assert sum(f.param_tensors for f in facts) == 36 == len(g.param_shapes) - 1
    assert facts[0].param_tensors == 1 and facts[-1].param_tensors == 0


def test_optimizer_pays_per_tensor_it_updates():
    g = gpt_graph(layers=2, hidden=64, heads=4, seq=32, vocab=256)
    c = Cluster.preset("a100-80gb")
    slow = dataclasses.replace(c, optimizer_tensor_s=1e-3)
    n = 36  # parameter tensors, the tied weight once
    base, more = (cost_plan(_plan("ddp"), g, x, validate=False, global_batch=16) for x in (c, slow))
    # DDP: the user's optimizer over every parameter tensor, 1 ms each
    assert more.optimizer_s - base.optimizer_s == pytest.approx(n * 1e-3)
    assert more.step_time_s - base.step_time_s == pytest.approx(n * 1e-3)
    # ZeRO-2: one flat fp32 shard per 25 MB gradient bucket: the model's 0.4 MB is one
    base, more = (cost_plan(_plan("zero2"), g, x, validate=False, global_batch=16) for x in (c, slow))
    assert more.optimizer_s - base.optimizer_s == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="optimizer_tensor_s must be >= 0"):
        dataclasses.replace(c, optimizer_tensor_s=-1.0)


def test_calibration_fits_the_per_tensor_slope():
    # synthetic steps: 250 us fixed + 50 us per tensor
    slope, intercept = fit_slope([(1, 3e-4), (16, 1.05e-3), (64, 3.45e-3)])
    assert slope == pytest.approx(5e-5) and intercept == pytest.approx(2.5e-4)
    # noise that makes the line fall is clamped: no negative cost
    assert fit_slope([(1, 2e-4), (64, 1e-4)])[0] == 0.0
