"""The planner at GPU scale: mixed precision by default, idle devices when faster, pipelines with
enough microbatches, partial nodes, MFU and HFU, FSDP units below the block, an infeasible search
that does not search twice."""

from __future__ import annotations

import dataclasses

import pytest

from planner.api import plan_for
from planner.cluster import Cluster, default_compute_dtype
from planner.cost_gpt import gpt_graph
from planner.plan import DataParallel, Mesh, Plan, PlanError, Schedule
from planner.search import NoFeasiblePlan, cost_plan, default_tp_rules, search
from planner.validate import validate_plan

GiB = 2**30


@pytest.fixture(scope="module")
def gpt125m():
    """GPT-3 Small's shape (12 layers, width 768, 12 heads), sequence 2048."""
    return gpt_graph(layers=12, hidden=768, heads=12, seq=2048, vocab=51200)


def test_mixed_precision_is_the_default_on_gpus_and_fp32_on_cpu_ranks():
    g = gpt_graph(layers=4, hidden=256, heads=8, seq=128, vocab=1000)
    a100 = Cluster.preset("a100-80gb")
    assert default_compute_dtype(a100) == "bf16" and default_compute_dtype(Cluster.cpu(4)) == "fp32"
    plan = search(g, a100, global_batch=16).plan
    assert (plan.data_parallel.param_dtype, plan.data_parallel.reduce_dtype) == ("bf16", "fp32")
    assert plan.predicted.notes[0] == ("precision: mixed, bf16 compute: bf16 parameters and activations, fp32 master "
                                       "weights and Adam states, gradients reduced in fp32")
    assert search(g, Cluster.cpu(4, memory_bytes=GiB), global_batch=16).plan.data_parallel.param_dtype == "fp32"
    # a GPU without bf16 tensor cores (V100: fp16 125 TFLOP/s, bf16 only at the fp32 rate) trains in fp16
    v100 = dataclasses.replace(a100, name="v100-like", device="Tesla V100-SXM2-32GB",
                               peak_flops={"fp32": 15.7e12, "tf32": 15.7e12, "bf16": 15.7e12, "fp16": 125e12})
    assert default_compute_dtype(v100) == "fp16"
    notes = search(g, v100, global_batch=16).plan.predicted.notes
    assert notes[0].startswith("precision: mixed, fp16 compute (needs loss scaling")
    # asked for explicitly, by dtype= or by the constraints (which must agree)
    assert search(g, a100, global_batch=16, dtype="fp32").plan.data_parallel.param_dtype == "fp32"
    assert search(g, a100, global_batch=16, dtype="float16").plan.data_parallel.param_dtype == "fp16"
    with pytest.raises(PlanError, match='dtype: \'fp32\', but the constraints fix data_parallel.param_dtype "bf16"'):
        search(g, a100, global_batch=16, dtype="fp32", constraints={"data_parallel": {"param_dtype": "bf16"}})
    with pytest.raises(PlanError, match="dtype: 'fp64' is not one of fp32, bf16, fp16"):
        search(g, a100, global_batch=16, dtype="fp64")
    # bf16 runs at the bf16 peak; fp32 on GPUs at the TF32 peak (the runtime enables TF32): half of it
    fp32 = search(g, a100, global_batch=16, dtype="fp32").best.breakdown
    bf16 = search(g, a100, global_batch=16).best.breakdown
    assert bf16.compute_s < fp32.compute_s / 1.5
    assert a100.compute_flops("fp32") == a100.peak_flops["tf32"] == a100.compute_flops("bf16") / 2
    cpu = Cluster.cpu(4)
    assert cpu.compute_flops("fp32") == cpu.peak_flops["fp32"]  # CPU ranks have no TF32


def test_a_small_model_on_many_gpus_leaves_devices_idle_rather_than_starve_a_pipeline(gpt125m):
    """125M parameters, batch 512, 3072 A100s: the old planner had to fill every device and chose
    pp=6 dp=512 with one microbatch (GPipe, 5/6 idle). Now it may use fewer and says why."""
    cluster = Cluster.preset("a100-80gb", devices=3072)
    r = search(gpt125m, cluster, global_batch=512, tp_rules=default_tp_rules(gpt125m))
    plan, b = r.plan, r.best.breakdown
    assert not (plan.mesh.pp == 6 and plan.mesh.dp == 512 and plan.schedule.microbatches == 1)
    assert plan.schedule.microbatches >= plan.mesh.pp
    assert b.devices < 3072 and plan.predicted.devices_used == plan.mesh.size == b.devices
    idle = [n for n in plan.predicted.notes if n.startswith("using ")]
    assert idle == [idle[0]] and idle[0].startswith(f"using {b.devices} of 3072 devices; more would be slower: the "
                                                    "best plan on all 3072 devices (pp=")
    validate_plan(plan, gpt125m, cluster)  # a plan may use part of its cluster ...
    with pytest.raises(PlanError, match=rf"but 3072 devices were given.*launch {b.devices} ranks"):
        validate_plan(plan, gpt125m, cluster, devices=3072)  # ... a launch of 3072 ranks may not
    # a launched world needs every rank: then the pipeline is short of microbatches, and the plan says why
    full = search(gpt125m, cluster, global_batch=512, tp_rules=default_tp_rules(gpt125m), use_all_devices=True).plan
    assert full.mesh.size == 3072
    if full.schedule.microbatches < full.mesh.pp:
        assert full.schedule.kind == "gpipe"
        assert any("the pipeline is never full" in n for n in full.predicted.notes)


def test_pipelines_get_at_least_as_many_microbatches_as_stages():
    g = gpt_graph(layers=8, hidden=512, heads=8, seq=256, vocab=1000)
    for devices, batch in ((16, 64), (64, 64), (32, 32)):
        r = search(g, Cluster.preset("a100-80gb", devices=devices), global_batch=batch, top_k=5)
        for cand in [r.best, *r.runners_up]:
            assert cand.plan.schedule.microbatches >= cand.plan.mesh.pp, cand.summary()
    # only when nothing else exists: a batch of 1 on a model that needs 2 stages to fit (no tp rules)
    big = gpt_graph(layers=8, hidden=512, heads=8, seq=128, vocab=1000)  # 26M parameters: 0.42 GB of fp32 states
    tight = dataclasses.replace(Cluster.cpu(2), memory_bytes=int(0.35 * 2**30))
    plan = search(big, tight, global_batch=1, tp_rules={}).plan
    assert (plan.mesh.pp, plan.schedule.microbatches, plan.schedule.kind) == (2, 1, "gpipe")
    assert "1 microbatch for pp=2 stages: the pipeline is never full (GPipe)" in plan.predicted.notes[1]


@pytest.mark.parametrize("devices", [6, 7, 12])
def test_partial_nodes_are_planned(devices):
    g = gpt_graph(layers=4, hidden=256, heads=8, seq=128, vocab=1000)
    r = plan_for(g, "a100-80gb", devices=devices, global_batch=devices * 4, tp_rules=default_tp_rules(g))
    assert r.plan.mesh.size == devices  # the batch splits over all of them
    assert Cluster.from_dict(r.plan.cluster).devices == devices
    validate_plan(r.plan, g, None, devices=devices)


def test_mfu_and_hfu_count_model_flops_and_the_recomputed_forwards():
    g = gpt_graph(layers=4, hidden=1024, heads=8, seq=1024, vocab=1000)
    c = Cluster.preset("a100-80gb")
    plan = Plan(mesh=Mesh(pp=1, dp=8, tp=1), schedule=Schedule(kind="1f1b", microbatches=1, global_batch=8),
                data_parallel=DataParallel(kind="ddp", param_dtype="bf16"))
    none = cost_plan(plan, g, c)
    assert none.hfu == pytest.approx(none.mfu) and none.mfu == pytest.approx(none.tflops_per_device * 1e12 / 312e12)
    plan.recompute = {"layers.*": "full"}
    full = cost_plan(plan, g, c)
    blocks = sum(layer.flops_fwd for layer in g.layers if layer.block) / g.batch_size * 8
    assert full.hardware_flops == pytest.approx(full.model_flops + blocks)
    assert full.hfu > full.mfu and full.predicted.hfu == pytest.approx(full.hfu)
    assert full.predicted.hardware_tflops_per_device == pytest.approx(full.hardware_flops / full.step_time_s / 8 / 1e12)


def test_an_infeasible_search_searches_once_and_still_proposes_offload(monkeypatch):
    import planner.search.core as core

    calls = []
    real = core._explore
    monkeypatch.setattr(core, "_explore", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = gpt_graph(layers=4, hidden=512, heads=8, seq=64, vocab=1000)
    c = Cluster.from_dict({**Cluster.preset("a100-80gb").to_dict(), "devices_per_node": 2,
                           "memory_bytes": 64 * 2**20, "host_memory_bytes": 8 * GiB})
    with pytest.raises(NoFeasiblePlan, match=r"offload to the CPU, which fits: pp=\d+ dp=\d+ tp=\d+ .*fsdp.*\+offload"):
        search(g, c, global_batch=4)
    assert len(calls) == 2  # the search, and its retry with pipelines shorter than their stages: no offload search


def test_fsdp_units_below_the_block_make_a_large_model_fit():
    g = gpt_graph(layers=4, hidden=8192, heads=64, seq=512, vocab=1000)
    c = Cluster.preset("h100-sxm-80gb", nodes=8)
    plan = Plan(mesh=Mesh(pp=1, dp=64, tp=1), schedule=Schedule(kind="1f1b", microbatches=1, global_batch=64),
                data_parallel=DataParallel(kind="fsdp", units="layers.*", param_dtype="bf16"),
                recompute={"layers.*": "full"})
    block = cost_plan(plan, g, c)
    plan.data_parallel.units = "layers.*.attn, layers.*.mlp"
    sub = cost_plan(plan, g, c)
    # a block holds 12h² parameters: gathered (bf16) + prefetched + one fp32 gradient unit; attention
    # 4h² and MLP 8h² units alternate: in an attention's backward, it and the MLP before it gathered
    # beside the gradient of the MLP after it (unshard_buffer_bytes); the root unit (wte, wpe,
    # ln_f: (1000 + 512 + 2)·h) stays gathered throughout
    h = 8192
    root = (1000 + 512 + 2) * h * 2
    assert block.memory_parts[0]["buffers"] == pytest.approx(root + (12 + 12) * h * h * 2 + 12 * h * h * 4, rel=1e-3)
    assert sub.memory_parts[0]["buffers"] == pytest.approx(root + (4 + 8) * h * h * 2 + 8 * h * h * 4, rel=1e-3)
    # with memory between the two, the search refuses nothing: it picks the smaller units
    cap = (max(block.memory_bytes) + max(sub.memory_bytes)) / 2
    tight = dataclasses.replace(c, memory_bytes=int(cap / 0.92))
    r = search(g, tight, global_batch=64, constraints={"mesh": {"pp": 1, "tp": 1}, "data_parallel": {"kind": "fsdp"},
                                                          "recompute": {"layers.*": "full"}})
    assert r.plan.data_parallel.units == "layers.*.attn, layers.*.mlp"
    validate_plan(r.plan, g, tight)
    # a selector that selects no module holding parameters is an error, not one root unit
    with pytest.raises(PlanError, match=r'data_parallel.units: "blocks.\*.\*" selects no module holding parameters'):
        search(g, c, global_batch=64, constraints={"data_parallel": {"kind": "fsdp", "units": "blocks.*.*"}})
    plan.data_parallel.units = "blocks.*.*"
    with pytest.raises(PlanError, match="selects no module holding parameters"):
        cost_plan(plan, g, c, validate=False)
