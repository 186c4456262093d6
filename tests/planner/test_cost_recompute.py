"""Selective recompute costs, the memory breakdown by part, and per-stage times for the timeline."""

import pytest

from planner.cluster import Cluster
from planner.cost import CostOptions, LayerFacts, layer_costs
from planner.cost_gpt import gpt_graph
from planner.cost_memory import kept_bytes, model_state_bytes, model_state_parts, recompute_kinds, saved_activation_bytes
from planner.plan import DataParallel, Mesh, Plan, PlanError, Schedule, Stage
from planner.schedule import build_schedule, simulate
from planner.search import cost_plan, search

PARTS = ("parameters", "gradients", "optimizer", "activations", "buffers")


def test_kept_bytes_per_kind():
    # a GPT block: saves 1,056,768 B; its input is 65,536 B; matmul/attention outputs 659,456 B
    assert kept_bytes("none", saved=1056768, input=65536, selective=659456) == 1056768
    assert kept_bytes("full", saved=1056768, input=65536, selective=659456) == 65536
    assert kept_bytes("selective", saved=1056768, input=65536, selective=659456) == 724992
    with pytest.raises(ValueError, match="kind must be full, selective or none"):
        kept_bytes("some", saved=1, input=1, selective=1)


def test_model_state_parts_split_zero_accounting():
    # 1e9 bf16 parameters, ZeRO-2 over 4: params 2e9, grads 2e9/4, Adam 12e9/4
    parts = model_state_parts(1e9, dp_kind="zero2", dp=4, param_dtype="bf16")
    assert parts == pytest.approx({"parameters": 2e9, "gradients": 0.5e9, "optimizer": 3e9})
    assert sum(parts.values()) == pytest.approx(model_state_bytes(1e9, dp_kind="zero2", dp=4, param_dtype="bf16"))
    fsdp = model_state_parts(1e9, dp_kind="fsdp", dp=8)  # fp32 Adam: (4 + 4 + 8)/8 bytes each
    assert fsdp == pytest.approx({"parameters": 0.5e9, "gradients": 0.5e9, "optimizer": 1e9})


def test_layer_cost_selective_keeps_input_and_matmul_outputs():
    c = Cluster.preset("a100-80gb")
    f = LayerFacts(name="layers.0", index=0, block="layers.*", flops_fwd=2e12, flops_bwd=4e12, saved=1e9, input=1e8,
                   output=1e8, params=1000, selective=4e8)
    (lc,) = layer_costs([f], c, tp=1, micro=2, compute_dtype="fp32")
    # micro 2, fp32: input 2e8 + matmul outputs 8e8 kept
    assert lc.act_selective == pytest.approx(1e9)
    # recomputed: the memory-bound traffic of the other saved bytes, (2e9 - 8e8) / (2039e9 · 0.7)
    assert lc.rec_selective == pytest.approx(1.2e9 / (2039e9 * 0.7))
    assert lc.rec_selective == pytest.approx(0.00084076, rel=1e-4)


def test_saved_activation_bytes_sums_kept_bytes_per_layer():
    g = gpt_graph(layers=2, hidden=64, heads=4, seq=32, vocab=256, batch=8)
    sbh = 32 * 8 * 64
    none = saved_activation_bytes(g, {})
    assert none == sum(layer.saved_bytes for layer in g.layers)
    full = saved_activation_bytes(g, {"layers.*": "full"})
    assert none - full == pytest.approx(2 * (2 * (34 * sbh + 5 * 4 * 32 * 32 * 8) - 4 * sbh))
    selective = saved_activation_bytes(g, {"layers.*": "selective", "layers.1": "none"})
    # layers.0 keeps its input (sbh fp32) + 10·sbh fp32 matmul outputs + the 4·32·8 fp32 log-sum-exp
    assert none - selective == pytest.approx(2 * (34 * sbh + 5 * 4 * 32 * 32 * 8) - (11 * sbh * 4 + 4 * 32 * 8 * 4))
    assert saved_activation_bytes(g, {}, microbatch_rows=2) == pytest.approx(none / 4)
    assert recompute_kinds(["a", "layers.0"], {"layers.*": "full"}) == {"a": "none", "layers.0": "full"}


def _plan(recompute, *, pp=2, kind="1f1b", v=1, dp_kind="ddp"):
    stages = [Stage(layers="wte,wpe,layers.[0-1]"), Stage(layers="layers.[2-3],ln_f,lm_head")] if pp == 2 else []
    if v == 2:
        stages = [Stage(layers="wte,wpe,layers.0"), Stage(layers="layers.1"), Stage(layers="layers.2"),
                  Stage(layers="layers.3,ln_f,lm_head")]
    return Plan(mesh=Mesh(pp=pp, dp=8 // pp, tp=1), stages=stages,
                schedule=Schedule(kind=kind, microbatches=4, virtual_stages=v, global_batch=16),
                data_parallel=DataParallel(kind=dp_kind, units="layers.*" if dp_kind == "fsdp" else ""),
                recompute=recompute)


def test_cost_plan_costs_selective_between_none_and_full():
    g = gpt_graph(layers=4, hidden=256, heads=8, seq=128, vocab=1000)
    c = Cluster.preset("a100-80gb")
    none, full, sel = (cost_plan(_plan(r), g, c, validate=False)
                       for r in ({}, {"layers.*": "full"}, {"layers.*": "selective"}))
    for r in range(2):
        assert full.memory_parts[r]["activations"] < sel.memory_parts[r]["activations"] \
            < none.memory_parts[r]["activations"]
    assert none.recompute_s == 0 < sel.recompute_s < full.recompute_s
    assert none.step_time_s < sel.step_time_s < full.step_time_s


@pytest.mark.parametrize("dp_kind,kind,v", [("ddp", "1f1b", 1), ("fsdp", "interleaved", 2), ("zero2", "gpipe", 1)])
def test_memory_parts_sum_to_memory_and_stage_times_rebuild_rank_times(dp_kind, kind, v):
    g = gpt_graph(layers=4, hidden=256, heads=8, seq=128, vocab=1000)
    # ZeRO's paper runtime (CostOptions()): zero2 reduce-scatters each microbatch's gradients and keeps no
    # full-gradient buffer (fairscale's runtime accumulates them unsharded and reduces once: for_runtime)
    b = cost_plan(_plan({"layers.0": "selective"}, kind=kind, v=v, dp_kind=dp_kind), g, Cluster.preset("a100-80gb"),
                  options=CostOptions(), validate=False)
    assert len(b.memory_parts) == 2
    for r, parts in enumerate(b.memory_parts):
        assert tuple(parts) == PARTS
        assert sum(parts.values()) == pytest.approx(b.memory_bytes[r])
    assert (b.memory_parts[0]["buffers"] > 0) == (dp_kind == "fsdp")
    assert len(b.stage_f_s) == len(b.stage_b_s) == 2 * v
    for r in range(2):
        chunks = range(r, 2 * v, 2)
        compute = sum(b.stage_f_s[k] + b.stage_b_s[k] for k in chunks)
        assert b.rank_times_s[r] >= compute
        if dp_kind == "ddp":  # rank time = its chunks' forward + backward + its pipeline sends
            assert b.rank_times_s[r] - compute <= 2 * v * b.stage_comm_s * (1 + 1e-9)
        elif dp_kind == "zero2":  # ... + each microbatch's gradient reduce-scatter beyond its backward
            assert b.rank_times_s[r] - compute > 2 * v * b.stage_comm_s
    timeline = simulate(build_schedule(kind, pp=2, microbatches=4, virtual_stages=v), f_cost=b.stage_f_s,
                        b_cost=b.stage_b_s, comm_cost=b.stage_comm_s)
    assert timeline.makespan > 0


def test_search_keeps_a_fixed_selective_map():
    g = gpt_graph(layers=4, hidden=256, heads=8, seq=128, vocab=1000)
    res = search(g, Cluster.preset("a100-80gb"), global_batch=16,
                 constraints={"recompute": {"layers.*": "selective"}, "mesh": {"pp": 2}})
    assert res.plan.recompute == {"layers.[0-3]": "selective"}
    assert res.best.breakdown.config.selective == frozenset({2, 3, 4, 5})
    assert "selective 4" in res.best.summary()


def test_runtime_overlap_options_for_cpu_and_gpu():
    from planner.cost import CostOptions
    from planner.search.core import make_context

    cpu = CostOptions.for_runtime(Cluster.cpu(8))
    assert (cpu.overlap_dp, cpu.overlap_fsdp, cpu.overlap_tp, cpu.overlap_p2p) == (False, False, False, False)
    gpu = CostOptions.for_runtime(Cluster.preset("h100"))
    assert (gpu.overlap_dp, gpu.overlap_fsdp) == (True, True)  # async buckets and prefetch overlap on GPUs
    g = gpt_graph(layers=2, hidden=64, heads=4, seq=32, vocab=256)
    assert make_context(g, Cluster.cpu(8), global_batch=8, rules={}, options=None).options == cpu
    # GPU plans run on fairscale's runtime too: what it holds (unsharded accumulation, fp32 masters) is costed
    assert make_context(g, Cluster.preset("h100"), global_batch=8, rules={}, options=None).options == gpu


def test_search_never_proposes_1f1b_with_fewer_microbatches_than_stages():
    g = gpt_graph(layers=8, hidden=64, heads=4, seq=32, vocab=256)
    res = search(g, Cluster.cpu(8, memory_bytes=2**30), global_batch=8, top_k=8)
    for cand in [res.best, *res.runners_up]:
        s, pp = cand.plan.schedule, cand.plan.mesh.pp
        assert not (s.kind == "1f1b" and s.microbatches < pp), cand.summary()
    forced = search(g, Cluster.cpu(8, memory_bytes=2**30), global_batch=8,
                    constraints={"mesh": {"pp": 8}, "schedule": {"microbatches": 1}})
    assert forced.plan.schedule.kind == "gpipe"


def test_tied_weights_on_two_stages_stay_whole_under_sharded_kinds():
    g = gpt_graph(layers=4, hidden=64, heads=4, seq=32, vocab=256)  # wte tied to lm_head: 256·64 elements
    c = Cluster.cpu(8, memory_bytes=2**30)
    stages = [Stage(layers="wte,wpe,layers.[0-1]"), Stage(layers="layers.[2-3],ln_f,lm_head")]
    plan = Plan(mesh=Mesh(pp=2, dp=4, tp=1), stages=stages, data_parallel=DataParallel(kind="zero2"),
                schedule=Schedule(kind="1f1b", microbatches=2, global_batch=16))
    zero = cost_plan(plan, g, c, validate=False)
    plan.data_parallel = DataParallel(kind="ddp")
    ddp = cost_plan(plan, g, c, validate=False)
    tied = 256 * 64
    for r in range(2):  # the tied weight keeps ddp's 4 + 4 + 8 bytes per element on both stages
        z, d = zero.memory_parts[r], ddp.memory_parts[r]
        others = d["parameters"] / 4 - tied
        assert z["gradients"] == pytest.approx(tied * 4 + others * 4 / 4)
        assert z["optimizer"] == pytest.approx(tied * 8 + others * 8 / 4)
    res = search(g, c, global_batch=16, constraints={"mesh": {"pp": 2, "dp": 4}, "data_parallel": {"kind": "zero2"}})
    assert res.plan.data_parallel.kind == "zero2"


def test_a_tied_weight_listed_under_its_alias_is_still_tied():
    from planner.cost import layer_facts

    g = gpt_graph(layers=2, hidden=64, heads=4, seq=32, vocab=256)
    g.layers[-1].params = ["lm_head.weight"]  # capture lists the alias the head module uses
    head = layer_facts(g, {})[-1]
    assert head.tied == ((0, 256 * 64),)


def test_host_overhead_per_op_adds_to_forward_and_twice_to_backward():
    import dataclasses

    c = Cluster.preset("a100-80gb")
    f = LayerFacts(name="layers.0", index=0, block=None, flops_fwd=2e12, flops_bwd=4e12, saved=1e9, input=1e8,
                   output=1e8, params=1000, ops=30)
    (base,) = layer_costs([f], c, tp=1, micro=1, compute_dtype="fp32")
    (slow,) = layer_costs([f], dataclasses.replace(c, op_overhead_s=1e-5), tp=1, micro=1, compute_dtype="fp32")
    assert slow.fwd - base.fwd == pytest.approx(30 * 1e-5)   # 0.3 ms
    assert slow.bwd - base.bwd == pytest.approx(60 * 1e-5)   # 0.6 ms
    with pytest.raises(ValueError, match="op_overhead_s must be >= 0"):
        dataclasses.replace(c, op_overhead_s=-1.0)


def test_fsdp_accumulating_unsharded_gradients_holds_them_and_reduces_once():
    from planner.cost import CostOptions

    g = gpt_graph(layers=4, hidden=256, heads=8, seq=128, vocab=1000)
    c = Cluster.preset("a100-80gb")
    plan = _plan({}, pp=1, dp_kind="fsdp")  # dp 8, 4 microbatches
    plain = cost_plan(plan, g, c, validate=False, options=CostOptions(), global_batch=64)
    acc = cost_plan(plan, g, c, validate=False, options=CostOptions(accumulate_unsharded=True), global_batch=64)
    params = plain.memory_parts[0]["parameters"] * 8 / 4  # fp32: 4 bytes per element, sharded over 8
    assert acc.memory_parts[0]["buffers"] - plain.memory_parts[0]["buffers"] == pytest.approx(params * 4)
    # one reduce-scatter of the fp32 gradients instead of four: 3 × 7/8 × 4·params bytes fewer
    assert plain.comm_bytes - acc.comm_bytes == pytest.approx(3 * 7 / 8 * params * 4)


def test_ranks_time_sharing_cores_pay_no_cpu_for_the_bubble():
    import dataclasses

    from planner.search.evaluate import shared_core_pipeline_time

    # 8 balanced stages of 1 s, m = 8, 8 ranks on 2 cores: max(15 s / 4, 8 · 1 s) = 8 s
    assert shared_core_pipeline_time("1f1b", [1.0] * 8, 8, share=4.0) == pytest.approx(8.0)
    assert shared_core_pipeline_time("1f1b", [1.0] * 8, 8) == pytest.approx(15.0)
    # few microbatches: the chain dominates, (1 + 7) · 1 s / 4 = 2 s > 1 · 1 s
    assert shared_core_pipeline_time("1f1b", [1.0] * 8, 1, share=4.0) == pytest.approx(2.0)
    c = Cluster.cpu(8, memory_bytes=2**30)
    assert c.core_share == 1.0 and dataclasses.replace(c, shared_cores=2).core_share == 4.0
    assert dataclasses.replace(c, shared_cores=16).core_share == 1.0
    g = gpt_graph(layers=8, hidden=64, heads=4, seq=32, vocab=256)
    plan = Plan(mesh=Mesh(pp=8, dp=1, tp=1), schedule=Schedule(kind="1f1b", microbatches=8, global_batch=8),
                stages=[Stage(layers="wte,wpe,layers.0")] + [Stage(layers=f"layers.{i}") for i in range(1, 7)]
                + [Stage(layers="layers.7,ln_f,lm_head")])
    dedicated = cost_plan(plan, g, c, validate=False)
    shared = cost_plan(plan, g, dataclasses.replace(c, shared_cores=2), validate=False)
    assert shared.pipeline_s < dedicated.pipeline_s
    assert shared.pipeline_s == pytest.approx(max(dedicated.pipeline_s / 4, 8 * sum(dedicated.rank_times_s) / 8))


def test_ranks_time_sharing_cores_pay_the_measured_idle_cores_on_their_cpu_work():
    import dataclasses

    from planner.search.evaluate import shared_core_idle_s

    # 0.5 s of CPU work per rank, cores idle 10% of it, a CPU-bound step of 0.5 s: 0.05 s more
    assert shared_core_idle_s(0.5, 0.5, share=4.0, idle=0.1) == pytest.approx(0.05)
    # the dependency chain already leaves the cores idle longer than that: nothing more
    assert shared_core_idle_s(0.5, 0.6, share=4.0, idle=0.1) == 0.0
    assert shared_core_idle_s(0.5, 0.52, share=4.0, idle=0.1) == pytest.approx(0.03)
    # a core per rank (GPUs, or as many cores as ranks): waits are costed as waits
    assert shared_core_idle_s(0.5, 0.5, share=1.0, idle=0.1) == 0.0
    c = Cluster.cpu(8, memory_bytes=2**30)
    g = gpt_graph(layers=4, hidden=64, heads=4, seq=32, vocab=256)
    plan = Plan(mesh=Mesh(pp=1, dp=1, tp=1), schedule=Schedule(kind="1f1b", microbatches=2, global_batch=8))
    shared = dataclasses.replace(c, shared_cores=2)
    base = cost_plan(plan, g, shared, validate=False)
    idle = cost_plan(plan, g, dataclasses.replace(shared, core_idle=0.1), validate=False)
    assert base.idle_s == 0.0 and idle.idle_s == pytest.approx(0.1 * base.step_time_s)  # one rank: all CPU work
    assert idle.step_time_s == pytest.approx(base.step_time_s + idle.idle_s) and idle.pipeline_s == base.pipeline_s
    dedicated = cost_plan(plan, g, dataclasses.replace(c, core_idle=0.1), validate=False)
    assert dedicated.idle_s == 0.0
    with pytest.raises(ValueError, match="core_idle must be >= 0"):
        dataclasses.replace(c, core_idle=-0.1)
    assert Cluster.from_dict(dataclasses.replace(shared, core_idle=0.1).to_dict()).core_idle == 0.1


def test_zero_shard_copy_adds_a_parameter_shard():
    from planner.cost import CostOptions

    g = gpt_graph(layers=4, hidden=256, heads=8, seq=128, vocab=1000)
    c = Cluster.preset("a100-80gb")
    plan = _plan({}, pp=1, dp_kind="zero2")
    base = cost_plan(plan, g, c, validate=False, options=CostOptions(), global_batch=64)
    copy = cost_plan(plan, g, c, validate=False, options=CostOptions(zero_shard_copy=True), global_batch=64)
    # fp32 parameters: P·4 bytes held in full, plus the optimizer's shard P·4/8
    assert copy.memory_parts[0]["parameters"] == pytest.approx(base.memory_parts[0]["parameters"] * 9 / 8)
