"""Stage partition vs brute force, constraints, re-costing, infeasible messages, determinism."""

import itertools
import random
import re

import pytest

from planner.cluster import Cluster
from planner.cost import CostOptions
from planner.cost_gpt import gpt_graph
from planner.plan import Plan, PlanError
from planner.search import NoFeasiblePlan, cost_plan, default_tp_rules, search
from planner.search.core import make_context
from planner.search.config import Config
from planner.search.partition import SegmentModel, partition_dp, partition_fast
from planner.validate import validate_plan

GiB = 2**30


def brute(seg, L, S):
    best = (float("inf"), ())
    for inner in itertools.combinations(range(1, L), S - 1):
        cuts = (0, *inner, L)
        worst = max(seg(a, b, k) for k, (a, b) in enumerate(zip(cuts, cuts[1:])))
        best = min(best, (worst, cuts), key=lambda x: x[0])
    return best


def random_seg(rng, L, S):
    """Monotone segment costs: sum of layer times, stage-dependent memory cap, inf when over it."""
    t = [rng.uniform(0.5, 2.0) for _ in range(L)]
    mem = [rng.uniform(1.0, 3.0) for _ in range(L)]
    cap = [rng.uniform(3.0, 8.0) for _ in range(S)]

    def seg(s, e, k):
        return sum(t[s:e]) if sum(mem[s:e]) <= cap[k] else float("inf")
    return seg


@pytest.mark.parametrize("seed", range(40))
def test_stage_dp_and_bisection_match_brute_force(seed):
    rng = random.Random(seed)
    L, S = rng.randint(2, 9), rng.randint(1, 4)
    if S > L:
        S = L
    seg = random_seg(rng, L, S)
    want, _ = brute(seg, L, S)
    got, cuts = partition_dp(seg, L, S)
    assert got == pytest.approx(want) if want != float("inf") else got == want
    fast, fcuts = partition_fast(seg, L, S, rel_tol=1e-9)
    if want == float("inf"):
        assert fast == want and fcuts == ()
    else:
        assert fast == pytest.approx(want, rel=1e-6)
        assert max(seg(a, b, k) for k, (a, b) in enumerate(zip(fcuts, fcuts[1:]))) == pytest.approx(want, rel=1e-6)


def test_partition_of_a_real_segment_model_matches_brute_force():
    g = gpt_graph(layers=6, hidden=256, heads=8, seq=128, vocab=1000)
    ctx = make_context(g, Cluster.preset("a100-80gb"), global_batch=8, rules=default_tp_rules(g), options=None)
    cfg = Config(pp=3, dp=1, tp=1, microbatches=8, param_dtype="bf16")
    model = SegmentModel(ctx, cfg, ctx.costs(1, 1, "bf16", False))
    want, _ = brute(model.time, model.L, 3)
    assert partition_dp(model.time, model.L, 3)[0] == pytest.approx(want)
    assert partition_fast(model.time, model.L, 3, rel_tol=1e-9)[0] == pytest.approx(want, rel=1e-6)
    # uneven stages: the light embeddings ride with the first blocks
    cuts = partition_dp(model.time, model.L, 3)[1]
    assert cuts[1] >= 3


@pytest.fixture(scope="module")
def small():
    return gpt_graph(layers=4, hidden=64, heads=4, seq=32, vocab=256, batch=1)


def test_search_is_deterministic_and_plans_validate(small):
    c = Cluster.cpu(4, memory_bytes=GiB)
    a = search(small, c, global_batch=8)
    b = search(small, c, global_batch=8)
    assert a.plan.to_json() == b.plan.to_json()
    assert [r.plan.to_json() for r in a.runners_up] == [r.plan.to_json() for r in b.runners_up]
    for cand in [a.best, *a.runners_up]:
        validate_plan(cand.plan, small, c)
    assert a.plan.mesh.size == 4
    assert a.plan.predicted.step_time_s > 0 and a.plan.predicted.memory_gib


def test_runners_up_are_slower_with_reasons(small):
    r = search(small, Cluster.cpu(8, memory_bytes=GiB), global_batch=16, top_k=3)
    assert len(r.runners_up) == 3
    times = [r.best.breakdown.step_time_s] + [c.breakdown.step_time_s for c in r.runners_up]
    assert times == sorted(times)
    for c in r.runners_up:
        assert "slower" in c.reason or "ties" in c.reason
    meshes = {(c.plan.mesh.pp, c.plan.mesh.dp, c.plan.mesh.tp) for c in [r.best, *r.runners_up]}
    assert len(meshes) == 4  # one per mesh shape
    assert "best:" in r.table() and "lost:" in r.table()


@pytest.mark.parametrize("constraints, check", [
    ({"mesh": {"tp": 2}}, lambda p: p.mesh.tp == 2 and p.tensor_parallel.rules),
    ({"pp": 2, "schedule": {"kind": "gpipe"}}, lambda p: p.mesh.pp == 2 and p.schedule.kind == "gpipe"),
    ({"pp": 2, "schedule": {"kind": "interleaved", "virtual_stages": 2}},
     lambda p: p.schedule.virtual_stages == 2 and len(p.stages) == 4),
    ({"data_parallel": {"kind": "zero1", "param_dtype": "bf16"}},
     lambda p: p.data_parallel.kind == "zero1" and p.data_parallel.param_dtype == "bf16"),
    ({"data_parallel": {"kind": "fsdp", "reshard_after_forward": False}},
     lambda p: p.data_parallel.kind == "fsdp" and not p.data_parallel.reshard_after_forward),
    ({"microbatches": 4}, lambda p: p.schedule.microbatches == 4),
    ({"recompute": {"layers.[0-1]": "full"}}, lambda p: p.recompute == {"layers.[0-1]": "full"}),
    ({"pp": 2, "stages": [{"layers": "wte, wpe, layers.0"}, {"layers": "layers.[1-3], ln_f, lm_head"}]},
     lambda p: [s.layers for s in p.stages] == ["wte, wpe, layers.0", "layers.[1-3], ln_f, lm_head"]),
])
def test_constraints_are_respected(small, constraints, check):
    r = search(small, Cluster.cpu(4, memory_bytes=GiB), global_batch=8, constraints=constraints)
    for cand in [r.best, *r.runners_up]:
        assert check(cand.plan), cand.plan.to_json()


def test_a_whole_plan_as_constraints_and_a_hand_edited_plan_are_recosted(small):
    c = Cluster.cpu(4, memory_bytes=GiB)
    r = search(small, c, global_batch=8, constraints={"pp": 2, "schedule": {"kind": "1f1b"}})
    plan = r.plan
    again = cost_plan(plan, small, c, global_batch=8)
    assert again.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-12)
    assert again.predicted.memory_gib == pytest.approx(plan.predicted.memory_gib)
    fixed = search(small, c, global_batch=8, constraints=plan)
    assert fixed.best.breakdown.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-12)
    # hand edit: move every block to the second stage and recompute them all
    edited = Plan.from_json(plan.to_json())
    edited.stages[0].layers = "wte, wpe"
    edited.stages[1].layers = "layers.[0-3], ln_f, lm_head"
    edited.recompute = {"layers.*": "full"}
    worse = cost_plan(edited, small, c, global_batch=8)
    assert worse.step_time_s > plan.predicted.step_time_s
    assert worse.recompute_s > 0
    assert worse.config.cuts == (0, 2, 8)


def test_infeasible_names_the_shortfall_and_the_fixes():
    g = gpt_graph(layers=4, hidden=512, heads=8, seq=64, vocab=1000)
    tiny = Cluster.cpu(2, memory_bytes=8 * 2**20)
    with pytest.raises(NoFeasiblePlan) as err:
        search(g, tiny, global_batch=4)
    msg = str(err.value)
    assert "no plan fits in memory on 2 × cpu: the closest" in msg
    assert "GiB over the 0.0 GiB usable" in msg
    assert "To make it fit: more devices (model states alone need at least" in msg
    assert "offload" in msg and "recompute" in msg
    assert err.value.shortfall_bytes > 0
    with pytest.raises(NoFeasiblePlan, match="let the planner recompute"):
        search(g, tiny, global_batch=4, constraints={"recompute": {}})


def test_bad_constraints_are_reported_with_what_is_allowed(small):
    c = Cluster.cpu(4, memory_bytes=GiB)
    with pytest.raises(PlanError, match="colour: unknown constraint; use one of"):
        search(small, c, global_batch=8, constraints={"colour": 1})
    with pytest.raises(PlanError, match=r"mesh.tp: tp=8 is not possible here; allowed degrees are \[1, 2, 4\]"):
        search(small, Cluster.cpu(8, memory_bytes=GiB), global_batch=8, constraints={"tp": 8})
    with pytest.raises(PlanError, match='the cost model offloads FSDP shards only, but data_parallel.kind is "ddp"'):
        search(small, c, global_batch=8, constraints={"data_parallel": {"kind": "ddp", "offload": True}})
    with pytest.raises(PlanError, match="no configuration satisfies the constraints: dp=4 does not divide"):
        search(small, c, global_batch=6, constraints={"dp": 4})
    # a rule that selects no module (a typo): the search kept it, and parallelize(plan=) of its plan refused it
    with pytest.raises(PlanError, match=re.escape('tensor_parallel.rules["layers.*.mlp.up_projj"]: '
                                                  '"layers.*.mlp.up_projj" matches no module; did you mean')):
        search(small, c, global_batch=8, constraints={"tp": 2, "tensor_parallel": {"rules": {
            "layers.*.mlp.up_projj": "colwise", "layers.*.mlp.down_proj": "rowwise"}}})
    # a schedule kind that cannot run the asked microbatches says why (was: "(none enumerated)")
    with pytest.raises(PlanError, match=r"pp=4 dp=1 tp=1, 2 microbatch\(es\): 1f1b with pp\(4\) needs at least 4 "
                                        r"microbatches, got 2.*or kind \"gpipe\""):
        search(small, c, global_batch=8, constraints={"mesh": {"pp": 4, "dp": 1, "tp": 1},
                                                      "schedule": {"kind": "1f1b", "microbatches": 2}})


def test_progress_is_reported(small):
    seen = []
    search(small, Cluster.cpu(4, memory_bytes=GiB), global_batch=8, progress=lambda d, t, b: seen.append((d, t, b)))
    assert seen and seen[-1][0] == seen[-1][1] and seen[-1][2] > 0


def test_tp_rules_given_as_data_replace_the_default(small):
    rules = {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    r = search(small, Cluster.cpu(4, memory_bytes=GiB), global_batch=8, constraints={"tp": 2}, tp_rules=rules)
    assert r.plan.tensor_parallel.rules == rules
    assert default_tp_rules(small)["layers.*.attn.q_proj"] == "colwise"
    assert default_tp_rules(small)["wte"] == "vocab_embedding"


def test_megatron_runs_with_their_own_settings_are_predicted_within_10_percent():
    """What benchmarks/planner/megatron_quality.py reports, kept honest: every Table 1 run, costed
    with the plan it ran, against the step time its published TFLOP/s imply. The search beats the
    run's own plan under the same cost model (rows 1 and 5: one of each runtime)."""
    from planner.api import plan_for
    from planner.cost_gpt import TABLE1, megatron_plan

    errors = []
    for i, run in enumerate(TABLE1):
        g = run.graph()
        cluster = Cluster.preset("a100-80gb", devices=run.gpus)
        opts = CostOptions.megatron2021(torch_ddp=run.torch_ddp)
        b = cost_plan(megatron_plan(run, g, default_tp_rules(g)), g, cluster, options=opts)
        errors.append(b.step_time_s / run.published_step_s() - 1)
        if i in (0, 4):
            dtypes = {"param_dtype": "fp16", "reduce_dtype": "fp16", "bucket_mb": 25.0 if run.torch_ddp else 2.0**20}
            ours = plan_for(g, cluster, global_batch=run.global_batch, tp_rules=default_tp_rules(g), options=opts,
                            constraints={"data_parallel": dtypes})
            assert ours.best.breakdown.step_time_s <= b.step_time_s
    assert all(abs(e) <= 0.10 for e in errors), errors


def test_plan_for_entry_point_and_progress_printer(small):
    import io

    from planner.api import plan_for, progress_printer, resolve_cluster

    assert resolve_cluster("a100-80gb:4").devices == 32
    assert resolve_cluster(2).name == "cpu" and resolve_cluster(2).devices == 2
    assert resolve_cluster({"preset": "h200"}).name == "h200"
    assert resolve_cluster("a100-80gb", devices=6).devices == 6  # a partial node
    assert resolve_cluster(Cluster.preset("h100", nodes=2), devices=12).last_node_devices == 4
    assert resolve_cluster(None, devices=3) == Cluster.cpu(3)  # no GPU here: CPU ranks
    with pytest.raises(ValueError, match=r"devices=24, but the cluster has 16 \(2 node\(s\) of 8\)"):
        resolve_cluster(Cluster.preset("h100", nodes=2), devices=24)
    with pytest.raises(TypeError, match="cluster must be a Cluster"):
        resolve_cluster(2.5)
    out = io.StringIO()
    r = plan_for(small, Cluster.cpu(2, memory_bytes=GiB), global_batch=4, progress=progress_printer(out))
    assert r.plan.mesh.size == 2 and r.plan.schedule.global_batch == 4
    assert "planning:" in out.getvalue() and "configurations, best" in out.getvalue()
    assert plan_for(small, Cluster.cpu(1, memory_bytes=GiB)).plan.schedule.global_batch == small.batch_size


def test_tp_rules_may_depend_on_the_degree(small):
    asked = []

    def rules(tp):
        asked.append(tp)
        return {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"} if tp == 2 else {}
    r = search(small, Cluster.cpu(4, memory_bytes=GiB), global_batch=8, tp_rules=rules, top_k=5)
    tps = {c.plan.mesh.tp for c in [r.best, *r.runners_up]}
    assert tps <= {1, 2} and 4 in asked  # tp=4 was asked for, got no rules, so was never planned
    for c in [r.best, *r.runners_up]:
        assert bool(c.plan.tensor_parallel.rules) == (c.plan.mesh.tp == 2)


def test_branch_and_bound_finds_the_exhaustive_optimum(monkeypatch):
    """Pruning by the (fluid) lower bound must not lose the best plan: compare with a search that
    visits every configuration, on a model that needs recompute to fit."""
    import math

    import planner.search.core as core

    g = gpt_graph(layers=8, hidden=256, heads=8, seq=2048, vocab=1000)
    c = Cluster.from_dict({**Cluster.preset("a100-40gb").to_dict(), "memory_bytes": 512 * 2**20})
    pruned = search(g, c, global_batch=16)
    real = core.bounds
    monkeypatch.setattr(core, "bounds", lambda ctx, cfg, tot: (
        lambda lb, mem: (lb if math.isinf(lb) else 0.0, mem))(*real(ctx, cfg, tot)))
    full = search(g, c, global_batch=16)
    assert full.evaluated > pruned.evaluated
    assert pruned.best.breakdown.step_time_s == pytest.approx(full.best.breakdown.step_time_s, rel=1e-12)
    assert pruned.best.breakdown.recompute_s > 0


def test_an_unannotated_graph_is_refused():
    g = gpt_graph(layers=2, hidden=64, heads=4, seq=32, vocab=256)
    for layer in g.layers:
        layer.flops_fwd = layer.flops_bwd = 0
    with pytest.raises(ValueError, match="the graph carries no FLOPs"):
        search(g, Cluster.cpu(2, memory_bytes=GiB), global_batch=2)


def test_offload_is_proposed_when_nothing_else_fits_and_costed_when_asked_for():
    g = gpt_graph(layers=4, hidden=512, heads=8, seq=64, vocab=1000)  # 13.1M params: 210 MB of states
    base = Cluster.preset("a100-80gb").to_dict()
    c = Cluster.from_dict({**base, "devices_per_node": 2, "memory_bytes": 64 * 2**20,
                           "host_memory_bytes": 8 * GiB})
    with pytest.raises(NoFeasiblePlan, match=r"offload to the CPU, which fits: pp=\d+ dp=\d+ tp=\d+ .*fsdp.*\+offload"):
        search(g, c, global_batch=4)
    r = search(g, c, global_batch=4, constraints={"data_parallel": {"offload": True}})
    for cand in [r.best, *r.runners_up]:
        dp = cand.plan.data_parallel
        assert dp.offload and dp.kind == "fsdp"
        assert cand.breakdown.host_memory_bytes > 0 and cand.breakdown.fits
    again = cost_plan(r.plan, g, c)
    assert again.step_time_s == pytest.approx(r.plan.predicted.step_time_s, rel=1e-12)
    no_host = Cluster.from_dict({**c.to_dict(), "host_memory_bytes": 2**20})
    with pytest.raises(NoFeasiblePlan, match="with these constraints it does not fit either"):
        search(g, no_host, global_batch=4)


def test_stage_cuts_keep_light_layers_with_their_neighbours():
    """Six blocks, a final norm and a light head on 4 stages: the bottleneck is two blocks however
    the rest falls; a greedy fill packs three stages with two blocks and leaves the norm and the
    head alone on the last one. The balanced cut keeps the bottleneck and the head with a block."""
    from planner.search.partition import balanced_cuts

    t = [1.0] * 6 + [0.01, 0.5]
    prefix = [sum(t[:i]) for i in range(len(t) + 1)]

    def seg(s, e, k):
        return sum(t[s:e])
    best, greedy = partition_fast(seg, 8, 4, rel_tol=1e-12)
    assert best == pytest.approx(2.0) and greedy[-2] == 6  # norm and head alone
    cuts = balanced_cuts(seg, prefix, 8, 4, best)
    assert max(seg(a, b, k) for k, (a, b) in enumerate(zip(cuts, cuts[1:]))) <= best + 1e-12
    assert cuts[-2] <= 5  # the last stage holds a block besides the norm and the head
    for seed in range(30):  # and on random monotone costs it never loses the optimal bottleneck
        rng = random.Random(seed)
        L, S = rng.randint(3, 9), rng.randint(2, 4)
        S = min(S, L)
        seg_r = random_seg(rng, L, S)
        want, _ = partition_dp(seg_r, L, S)
        if want == float("inf"):
            continue
        pre = [seg_r(0, i, 0) if i else 0.0 for i in range(L + 1)]
        got = balanced_cuts(seg_r, [p if p < float("inf") else 1e300 for p in pre], L, S, want)
        assert got is not None
        assert max(seg_r(a, b, k) for k, (a, b) in enumerate(zip(got, got[1:]))) <= want * (1 + 1e-9)
