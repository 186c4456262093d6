"""The host cost of a collective call by group size (Cluster.collective_call_s, planner.cost_host):
interpolated by hand, charged per tensor-parallel reduction (twice under sequence parallelism), and
measured by calibration in CPU time × ranks per core (what waiting and other users' load do not change)."""

import dataclasses
import time

import pytest

from planner.cluster import Cluster
from planner.cost import layer_costs, layer_facts
from planner.cost_gpt import gpt_graph
from planner.cost_host import call_seconds, tp_link


def test_call_seconds_by_group_size_by_hand():
    calls = {2: 1e-3, 8: 8e-3}
    assert call_seconds(calls, 2) == pytest.approx(1e-3)
    assert call_seconds(calls, 4) == pytest.approx(1e-3 + 7e-3 * 2 / 6)  # linear between 2 and 8
    assert call_seconds(calls, 16) == pytest.approx(8e-3 * 15 / 7)  # proportional to the peers beyond 8
    assert call_seconds(calls, 1) == 0.0 and call_seconds({}, 4) == 0.0
    assert call_seconds({4: 2e-3}, 2) == pytest.approx(2e-3)  # the smallest measured below it


def _cpu(calls: dict[str, dict[int, float]]) -> Cluster:
    # a link so fast that only the per-call cost is left
    return dataclasses.replace(Cluster.cpu(8), intra_bandwidth=1e30, intra_latency=5e-3, collective_call_s=calls)


def test_tp_link_spreads_a_reductions_calls_over_its_ring_steps():
    c = _cpu({"all_reduce": {2: 1.2e-3, 8: 8.4e-3}, "all_gather": {2: 1e-3, 8: 7e-3}})
    assert tp_link(c, 2)[1] == pytest.approx(0.6e-3)  # one all-reduce call over 2 steps
    assert tp_link(c, 2, sequence_parallel=True)[1] == pytest.approx(1e-3)  # all-gather + reduce-scatter
    assert tp_link(c, 8)[1] == pytest.approx(8.4e-3 / 14)
    # no measured calls (GPUs): the link's latency
    assert tp_link(Cluster.preset("a100-80gb"), 8) == Cluster.preset("a100-80gb").link(8)
    assert tp_link(_cpu({}), 2)[1] == 5e-3
    with pytest.raises(ValueError, match="collective_call_s needs group sizes >= 2"):
        _cpu({"all_reduce": {1: 1e-3}})
    assert Cluster.from_dict(c.to_dict()) == c
    assert Cluster.from_dict({**c.to_dict(), "collective_call_s": {"all_reduce": {"2": 1.2e-3}}}) \
        .collective_call_s == {"all_reduce": {2: 1.2e-3}}


def test_each_tensor_parallel_reduction_pays_one_call_or_two_under_sequence_parallelism():
    g = gpt_graph(layers=2, hidden=64, heads=4, seq=32, vocab=256)
    rules = {"layers.*.attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.attn.o_proj": "rowwise",
             "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    facts = layer_facts(g, rules)
    c = _cpu({"all_reduce": {2: 1e-3}, "all_gather": {2: 2e-3}})
    blocks = [i for i, f in enumerate(facts) if f.tp.sharded and not f.tp.gather_bytes and not f.tp.loss_tokens]
    assert len(blocks) == 2
    for sp, per_call in ((False, 1e-3), (True, 2 * 2e-3)):
        costs = layer_costs(facts, c, tp=2, micro=1, compute_dtype="fp32", sequence_parallel=sp)
        for i in blocks:
            calls = facts[i].tp.allreduce_fwd + facts[i].tp.allreduce_bwd  # 2 + 2 in a Megatron block
            assert costs[i].tp_s == pytest.approx(calls * per_call)


def _cpu_time_in_ranks(rank: int, world: int) -> tuple[float, float]:
    from fairscale.runtime import calibrate as cal

    def spin() -> None:
        end = time.process_time() + 0.02
        while time.process_time() < end:
            pass
    # share 4: as 8 ranks on 2 cores
    return cal._time(lambda: time.sleep(0.02), repeat=3, share=4.0), cal._time(spin, repeat=3, share=4.0)


def test_calibration_times_cpu_work_times_ranks_per_core_and_not_waits():
    from fairscale.runtime.launch import launch

    # synthetic: sleeping 20 ms costs no CPU (a wait lends the core); 20 ms of CPU is 80 ms of a
    # rank's wall time when 4 ranks share each core, whatever else runs on the machine
    for sleep_s, spin_s in launch(_cpu_time_in_ranks, devices=2, backend="gloo"):
        assert sleep_s < 4 * 2e-3
        assert spin_s == pytest.approx(4 * 0.02, rel=0.05)


def test_full_recompute_pays_the_measured_host_cost_per_op_beyond_a_forward():
    from planner.cost_host import per_recomputed_op, recompute_host_s
    from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage
    from planner.search import cost_plan

    # hand example: 80 us per recomputed op against 30 us per forward op, 20 ops: 1 ms beyond the forward
    c = dataclasses.replace(Cluster.cpu(8), op_overhead_s=30e-6, recompute_op_s=80e-6)
    assert recompute_host_s(c, 20) == pytest.approx(1e-3)
    assert recompute_host_s(dataclasses.replace(c, recompute_op_s=0.0), 20) == 0.0  # a second forward only
    # synthetic fit: 4 ms plain, 6 ms with 40 ops checkpointed: 50 us per op; noise below plain: 0
    assert per_recomputed_op(4e-3, 6e-3, ops=40) == pytest.approx(50e-6)
    assert per_recomputed_op(4e-3, 3.9e-3, ops=40) == 0.0
    # in a plan: every block recomputed, one microbatch, one rank's stage: the step grows by the ops'
    # extra host cost once per microbatch
    g = gpt_graph(layers=2, hidden=64, heads=4, seq=32, vocab=256)
    ops = sum(f.ops for f in layer_facts(g, {}) if f.name.startswith("layers."))
    plan = Plan(mesh=Mesh(pp=1, dp=1, tp=1), stages=[Stage(layers="*")], schedule=Schedule(kind="1f1b", microbatches=1),
                data_parallel=DataParallel(kind="ddp"), recompute={"layers.*": "full"})
    base = dataclasses.replace(c, recompute_op_s=0.0, devices_per_node=1, shared_cores=0)
    a, b = (cost_plan(plan, g, x, validate=False, global_batch=4) for x in (base, dataclasses.replace(base, recompute_op_s=80e-6)))
    assert b.step_time_s - a.step_time_s == pytest.approx(ops * 50e-6)
    with pytest.raises(ValueError, match="recompute_op_s must be >= 0"):
        dataclasses.replace(c, recompute_op_s=-1.0)


def test_runtime_host_terms_by_hand():
    from planner.cost_host import RuntimeHostRun, fit_runtime_host, runtime_host_s

    c = dataclasses.replace(Cluster.cpu(8), step_host_s=2e-3, microbatch_host_s=3e-3, dp_tensor_host_s=40e-6)
    # 2 chunks (interleaved), dp 4, 100 tensors: 2 ms + 100 · 40 us per step, 2 · 3 ms per microbatch
    assert runtime_host_s(c, chunks=2, dp=4, tensors=100) == pytest.approx((6e-3, 6e-3))
    assert runtime_host_s(c, chunks=1, dp=1, tensors=100) == pytest.approx((2e-3, 3e-3))  # no dp: no hooks
    assert runtime_host_s(Cluster.preset("a100-80gb"), chunks=1, dp=8, tensors=100) == (0.0, 0.0)  # GPUs: hidden
    # synthetic fit: 8 ms at m = 2 and 26 ms at m = 8 without dp (3 ms per microbatch, 2 ms per step);
    # 15 ms at m = 1 with dp over 100 tensors: (15 - 2 - 3) / 100 = 100 us per tensor
    # 9 ms at m = 1 with 8 tensor-parallel ops: (9 - 2 - 3) / 8 = 500 us per op
    runs = [RuntimeHostRun(2, 1, 10, 8e-3), RuntimeHostRun(8, 1, 10, 26e-3), RuntimeHostRun(1, 2, 100, 15e-3),
            RuntimeHostRun(1, 1, 10, 9e-3, tp_ops=8)]
    assert fit_runtime_host(runs) == pytest.approx((2e-3, 3e-3, 1e-4, 5e-4))
    # every run with data parallelism, as on 8 ranks (pp 2 × dp 4 at m = 2 and 4 holding 50 tensors,
    # dp 8 and dp 4 × tp 2 holding 100): 2 + 2·3 + 50·0.1 = 13 ms, 19 ms, 2 + 3 + 10 = 15 ms, 15 + 8·0.5 = 19 ms
    runs = [RuntimeHostRun(2, 4, 50, 13e-3), RuntimeHostRun(4, 4, 50, 19e-3), RuntimeHostRun(1, 8, 100, 15e-3),
            RuntimeHostRun(1, 4, 100, 19e-3, tp_ops=8)]
    assert fit_runtime_host(runs) == pytest.approx((2e-3, 3e-3, 1e-4, 5e-4))
    # noise that makes more microbatches cheaper, and a dp run below the line: no coefficient goes
    # negative; the best such fit is a step cost alone, the runs' mean (10/3 ms)
    assert fit_runtime_host([RuntimeHostRun(2, 1, 10, 8e-3), RuntimeHostRun(8, 1, 10, 2e-3),
                             RuntimeHostRun(1, 2, 10, 0.0)]) == pytest.approx((10e-3 / 3, 0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="two or more microbatch counts"):
        fit_runtime_host([RuntimeHostRun(2, 1, 10, 8e-3), RuntimeHostRun(2, 2, 10, 8e-3),
                          RuntimeHostRun(1, 1, 10, 8e-3, tp_ops=4)])
    with pytest.raises(ValueError, match="microbatch_host_s must be >= 0"):
        dataclasses.replace(c, microbatch_host_s=-1.0)
    assert Cluster.from_dict(c.to_dict()) == c


def test_a_plan_pays_the_runtime_host_terms_per_step_microbatch_and_dp_tensor():
    from fairscale.closed_loop import predicted_terms
    from planner.plan import DataParallel, Mesh, Plan, Schedule
    from planner.search import cost_plan

    g = gpt_graph(layers=2, hidden=64, heads=4, seq=32, vocab=256)
    tensors = sum(f.param_tensors for f in layer_facts(g, {}))
    base = dataclasses.replace(Cluster.cpu(8), devices_per_node=1, shared_cores=0)
    host = dataclasses.replace(base, step_host_s=2e-3, microbatch_host_s=3e-3, dp_tensor_host_s=40e-6)

    def plan(dp: int, m: int) -> Plan:
        return Plan(mesh=Mesh(pp=1, dp=dp, tp=1), schedule=Schedule(kind="1f1b", microbatches=m),
                    data_parallel=DataParallel(kind="ddp"))
    # one rank, 4 microbatches: 2 ms + 4 · 3 ms more than without the terms, all of it in host_s
    a, b = (cost_plan(plan(1, 4), g, c, validate=False, global_batch=8) for c in (base, host))
    assert b.step_time_s - a.step_time_s == pytest.approx(2e-3 + 4 * 3e-3)
    assert a.host_s == 0.0 and b.host_s == pytest.approx(14e-3)
    # the closed loop's compute per pipeline rank includes it (measured compute = step - waits - optimizer)
    assert predicted_terms(b, plan(1, 4))["stage_compute_s"][0] - predicted_terms(a, plan(1, 4))["stage_compute_s"][0] \
        == pytest.approx(14e-3)
    # data parallelism adds its hooks per parameter tensor
    wide = dataclasses.replace(host, devices_per_node=2)
    d = cost_plan(plan(2, 1), g, wide, validate=False, global_batch=8)
    assert d.host_s == pytest.approx(2e-3 + 3e-3 + tensors * 40e-6)


def test_each_tensor_parallel_op_pays_the_runtimes_host_cost_with_the_layers_compute():
    from planner.cost_host import tp_op_calls

    assert tp_op_calls(allreduce_fwd=2, allreduce_bwd=2, gathers=False, loss_tokens=False) == (2, 2)
    assert tp_op_calls(allreduce_fwd=0, allreduce_bwd=1, gathers=False, loss_tokens=True) == (3, 1)
    g = gpt_graph(layers=2, hidden=64, heads=4, seq=32, vocab=256)
    rules = {"layers.*.attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.attn.o_proj": "rowwise",
             "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    facts = layer_facts(g, rules)
    c = _cpu({"all_reduce": {2: 1e-3}})
    a, b = (layer_costs(facts, x, tp=2, micro=1, compute_dtype="fp32")
            for x in (c, dataclasses.replace(c, tp_op_host_s=400e-6)))
    for f, ca, cb in zip(facts, a, b):
        n = (f.tp.allreduce_fwd, f.tp.allreduce_bwd) if f.tp.sharded else (0, 0)
        assert (cb.fwd - ca.fwd, cb.bwd - ca.bwd) == pytest.approx((n[0] * 400e-6, n[1] * 400e-6))
        assert cb.tp_s == ca.tp_s  # compute, not the collectives' wait: measured outside the waits
    assert sum(cb.fwd - ca.fwd for ca, cb in zip(a, b)) == pytest.approx(2 * 2 * 400e-6)  # 2 blocks × 2 forward
    # tp 1: nothing split, nothing charged
    assert [x.fwd for x in layer_costs(facts, dataclasses.replace(c, tp_op_host_s=1.0), tp=1, micro=1,
                                       compute_dtype="fp32")] == [x.fwd for x in layer_costs(facts, c, tp=1, micro=1,
                                                                                             compute_dtype="fp32")]
