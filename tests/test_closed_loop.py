"""The closed loop (fairscale.closed_loop): measure a deliberately bad plan, refit, switch live, and
continue exactly as a fresh run of the new plan from the same state."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import fairscale
from fairscale.api import captured
from fairscale.closed_loop import Measurement, predicted_terms, refit, steps_requested
from fairscale.testing.models import build
from fairscale.testing.reference import Trajectory, compare, train_reference
from planner.cluster import Cluster, link_at
from planner.cost_comm import all_reduce_time, reduce_scatter_time
from planner.plan import Mesh, Plan, Schedule, Stage
from planner.search import cost_plan

BATCH, LR, TIMED, TOTAL = 8, 1e-3, 2, 6
SWITCH_AT = TIMED + 1  # one warm-up step, then the timed ones; the switch follows the last


def _case():
    case = build("gpt")
    case.model.double()
    return case


def _pp4() -> Plan:
    """Four pipeline stages with one microbatch: three of four ranks idle at any time."""
    case = _case()
    names = [layer.name for layer in captured(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn).layers]
    per = len(names) // 4
    return Plan(mesh=Mesh(pp=4, dp=1, tp=1), schedule=Schedule(kind="gpipe", microbatches=1, global_batch=BATCH),
                stages=[Stage(layers=", ".join(names[i * per:(i + 1) * per if i < 3 else None])) for i in range(4)])


def _adam():
    return functools.partial(torch.optim.Adam, lr=LR)


def _loop(rank: int, world: int, plan: Plan):
    case = _case()
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=plan,
                               optimizer=_adam(), calibrate=TIMED)
    losses = [pm.train_step(case.make_batch(step, BATCH)) for step in range(TOTAL)]
    report = pm.closed_loop_report
    return losses, report.switched, pm.plan.to_dict(), report.text(), pm.state_dict()


def _fresh(rank: int, world: int, first: Plan, second: dict, path: str):
    """The first plan for SWITCH_AT steps, a checkpoint, then a fresh module of the second plan from it."""
    case = _case()
    batch = case.make_batch(0, BATCH)
    pm = fairscale.parallelize(case.model, example_inputs=batch, loss_fn=case.loss_fn, plan=first, optimizer=_adam())
    losses = [pm.train_step(case.make_batch(step, BATCH)) for step in range(SWITCH_AT)]
    pm.save_checkpoint(path)
    fresh = fairscale.parallelize(case.model, example_inputs=batch, loss_fn=case.loss_fn,
                                  plan=Plan.from_dict(second), optimizer=_adam())
    fresh.load_checkpoint(path)
    return losses + [fresh.train_step(case.make_batch(step, BATCH)) for step in range(SWITCH_AT, TOTAL)]


def test_closed_loop_leaves_a_bad_plan_and_continues_exactly(tmp_path):
    bad = _pp4()
    losses, switched, new, text, params = fairscale.launch(_loop, devices=4, args=(bad,))[0]
    assert switched, text
    assert new["mesh"]["pp"] < 4, text
    assert "seconds per step" in text and "compute, pipeline rank 3" in text and "refit error" in text
    assert "switched live from pp4×dp1×tp1" in text and "step per rank (s): " in text
    fresh = fairscale.launch(_fresh, devices=4, args=(bad, new, str(tmp_path / "ckpt")))[0]
    assert losses[SWITCH_AT:] == fresh[SWITCH_AT:]  # the same state under the same plan: bit for bit
    compare(train_reference(_case, steps=TOTAL, global_batch=BATCH, lr=LR), Trajectory(losses=losses, params=params),
            rtol=1e-10, atol=1e-9)


def _measured(predicted: dict, *, slower: float, alpha: float, beta: float, sizes: list[int]) -> Measurement:
    calls = [("all_reduce", 4, n, all_reduce_time(n, 4, bandwidth=beta, latency=alpha)) for n in sizes]
    return Measurement(steps=3, step_s=1.0, optimizer_s=0.0,
                       stage_compute_s=[t * slower for t in predicted["stage_compute_s"]], comm_s={}, calls=calls)


def test_refit_recovers_the_machine_it_measured():
    case = _case()
    graph = captured(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn)
    cluster = Cluster.cpu(4)
    plan = _pp4()
    predicted = predicted_terms(cost_plan(plan, graph, cluster), plan)
    # compute 3x slower than predicted, collectives from a known alpha-beta, at sizes 64 KiB .. 4 MiB
    got, fit = refit(cluster, predicted, _measured(predicted, slower=3.0, alpha=50e-6, beta=2e8,
                                                    sizes=[2**16, 2**18, 2**20, 2**22]))
    assert fit.compute_scale == pytest.approx(1 / 3)
    assert got.peak_flops["fp32"] == pytest.approx(cluster.peak_flops["fp32"] / 3)
    assert got.op_overhead_s == pytest.approx(cluster.op_overhead_s * 3)
    assert got.intra_latency == pytest.approx(50e-6, rel=1e-6)
    assert got.intra_bandwidth * got.efficiency.network == pytest.approx(2e8, rel=1e-6)
    refitted = predicted_terms(cost_plan(plan, graph, got), plan)
    assert refitted["stage_compute_s"] == pytest.approx([3 * t for t in predicted["stage_compute_s"]], rel=1e-6)
    # one message size determines one coefficient: the one that dominates it (here the bandwidth)
    one, fit = refit(cluster, predicted, _measured(predicted, slower=1.0, alpha=cluster.intra_latency, beta=1e8,
                                                    sizes=[2**22]))
    assert one.intra_latency == cluster.intra_latency
    assert one.intra_bandwidth * one.efficiency.network == pytest.approx(1e8, rel=1e-6)
    assert "bandwidth-bound messages of one size" in "\n".join(fit.how)
    # calibrated per-call costs by group size follow the refitted latency in proportion
    called = dataclasses.replace(cluster, collective_call_s={"all_reduce": {2: 1e-3, 4: 3e-3}})
    got, _ = refit(called, predicted, _measured(predicted, slower=1.0, alpha=2 * cluster.intra_latency, beta=2e8,
                                                sizes=[2**16, 2**18, 2**20, 2**22]))
    assert got.collective_call_s["all_reduce"] == pytest.approx({2: 2e-3, 4: 6e-3}, rel=1e-6)


def test_refit_keeps_each_calibrated_collective_on_its_own_link():
    # calibrated CPU ranks price the reduce-scatter per size range: its calls refit those rows by
    # one factor and stay out of the all-reduce link's fit (they had been fitted into it, and the
    # reduce-scatter's own prediction never moved)
    case = _case()
    graph = captured(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn)
    base = Cluster.cpu(4)
    rows = ((2**18, 4e8, 1e-3), (2**22, 1e8, 2e-3))
    cluster = dataclasses.replace(base, collective_ranges={"reduce_scatter": rows},
                                  collective_links={"reduce_scatter": (2e8, 1e-3)})
    plan = _pp4()
    predicted = predicted_terms(cost_plan(plan, graph, cluster), plan)
    measured = _measured(predicted, slower=1.0, alpha=50e-6, beta=2e8, sizes=[2**16, 2**18, 2**20, 2**22])
    eff = cluster.efficiency.network

    def rs_time(c, n):
        bw, lat = link_at(c.link_rows("reduce_scatter"), n)
        return reduce_scatter_time(n, 4, bandwidth=bw, latency=lat)
    rs = [("reduce_scatter", 4, n, 3 * rs_time(cluster, n)) for n in (2**16, 2**20)]  # 3x its rows' times
    got, fit = refit(cluster, predicted, dataclasses.replace(measured, calls=measured.calls + rs))
    assert got.intra_latency == pytest.approx(50e-6, rel=1e-6)  # from the all-reduces alone
    assert got.intra_bandwidth * eff == pytest.approx(2e8, rel=1e-6)
    for n in (2**10, 2**16, 2**20, 2**24):
        assert rs_time(got, n) == pytest.approx(3 * rs_time(cluster, n), rel=1e-9)
    assert got.collective_links["reduce_scatter"] == pytest.approx((2e8 / 3, 3e-3))
    assert "reduce_scatter: measured" in "\n".join(fit.how) and "its times × 3" in "\n".join(fit.how)


def test_calibrate_argument():
    assert steps_requested(True, {}) == 5
    assert steps_requested(3, {}) == 3
    assert steps_requested(False, {"FAIRSCALE_CALIBRATE": "4"}) == 0
    assert steps_requested(None, {"FAIRSCALE_CALIBRATE": "4"}) == 4
    assert steps_requested(None, {}) == 0
    with pytest.raises(ValueError, match=r"calibrate=0: give True, False or a number of steps to time \(>= 1\)"):
        steps_requested(0, {})


def test_run_calibrate_reaches_parallelize_in_the_script(tmp_path):
    from fairscale.cli import main

    script = tmp_path / "train.py"
    script.write_text("import os, sys\nfrom fairscale.closed_loop import steps_requested\n"
                      "open(sys.argv[1] + os.environ['RANK'], 'w').write(str(steps_requested(None, dict(os.environ))))\n")
    out = tmp_path / "steps"
    assert main(["run", "--devices", "2", "--calibrate", str(script), str(out)]) == 0
    assert [(tmp_path / f"steps{r}").read_text() for r in range(2)] == ["5", "5"]
    assert main(["run", "--devices", "2", "--calibrate-steps", "3", str(script), str(out)]) == 0
    assert (tmp_path / "steps1").read_text() == "3"


def test_measure_takes_the_slowest_rank_per_term_and_the_least_waiting_rank_per_collective():
    from fairscale.closed_loop import measure
    from fairscale.runtime.mesh import RankMesh

    def rank(steps, points):
        return {"steps": [{"step": s, "optimizer": o, "waits": w} for s, o, w in steps], "points": points}

    ar = ("all_reduce", "dp", 2, 4096)
    ranks = [  # pp2 x dp2: ranks 0, 1 on pipeline rank 0, ranks 2, 3 on pipeline rank 1
        rank([(1.0, 0.1, {"dp": 0.2, "pp": 0.1}), (1.2, 0.1, {"dp": 0.3, "pp": 0.1})], {ar: 0.05}),
        rank([(1.1, 0.2, {"dp": 0.1, "pp": 0.1}), (1.1, 0.2, {"dp": 0.1, "pp": 0.1})], {ar: 0.02}),
        rank([(0.9, 0.1, {"pp": 0.5}), (0.9, 0.1, {"pp": 0.4})], {}),
        rank([(0.9, 0.1, {"pp": 0.45}), (1.3, 0.1, {"pp": 0.45})], {("p2p", "pp", 2, 512): 0.01}),
    ]
    m = measure(ranks, RankMesh(2, 2, 1, 0))
    assert m.step_s == pytest.approx(1.2)  # the slowest rank's steps are 1.1 and 1.3
    assert m.optimizer_s == pytest.approx(0.2)
    # compute = step - optimizer - waits, median over steps, slowest rank of each pipeline rank
    assert m.stage_compute_s == pytest.approx([0.7, 0.55])  # ranks 1 (0.7, 0.7) and 3 (0.35, 0.75)
    assert m.comm_s["dp"] == pytest.approx(0.25) and m.comm_s["p2p"] == pytest.approx(0.45)
    assert m.calls == [("all_reduce", 2, 4096, 0.02)]  # point-to-point is not a collective point
    assert m.rank_step_s == pytest.approx([1.1, 1.1, 0.9, 1.1])

