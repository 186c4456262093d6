"""The search's lower bounds never exceed the exact cost: property test over random configurations.

Branch and bound (``planner.search.core``) skips a configuration whose bound cannot beat the
best found, so a bound above the exact cost would silently lose the best plan. For random GPT
shapes, clusters, runtimes (overlap on/off, unsharded accumulation, Megatron-2021), meshes,
schedules, data-parallel kinds, FSDP units and stage cuts (the partitioner's and random ones),
the bound on step time must be at most :func:`evaluate`'s step time of every cut that fits, and
the bound on memory at most the fullest rank's memory.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from planner.cluster import Cluster
from planner.cost import CostOptions
from planner.cost_gpt import gpt_graph
from planner.search import default_tp_rules
from planner.search.candidates import enumerate_configs
from planner.search.bounds import Totals, bounds, tied_elements
from planner.search.core import make_context, rules_function
from planner.search.evaluate import evaluate
from planner.search.memory import choose_recompute
from planner.search.partition import SegmentModel, partition
from planner.search.space import Fixed

GiB = 2**30


def _options(rng: random.Random) -> CostOptions:
    return rng.choice([
        CostOptions(),
        CostOptions(overlap_dp=False, overlap_fsdp=False),
        CostOptions(accumulate_unsharded=True, zero_shard_copy=True),
        CostOptions.megatron2021(),
        CostOptions.megatron2021(torch_ddp=True),
        CostOptions(overlap_tp=True, overlap_p2p=True),
    ])


def _cluster(rng: random.Random) -> Cluster:
    name = rng.choice(["a100-80gb", "h100-sxm-80gb", "a100-40gb"])
    c = Cluster.preset(name, devices=rng.choice([4, 8, 16, 24, 32]))
    # small memories make recompute and infeasibility common
    c = dataclasses.replace(c, memory_bytes=int(rng.choice([0.5, 2, 8, 80]) * GiB))
    if rng.random() < 0.5:  # all-gather and reduce-scatter on links of their own, as calibrated gloo ranks have
        bw, lat = c.intra_bandwidth, c.intra_latency
        c = dataclasses.replace(c, collective_links={"all_gather": (bw / rng.choice([1, 2, 4]), lat * rng.choice([1, 2])),
                                                     "reduce_scatter": (bw / rng.choice([1, 5, 9]), lat * 2)})
    return c


def _random_cuts(rng: random.Random, layers: int, stages: int) -> tuple[int, ...]:
    inner = sorted(rng.sample(range(1, layers), stages - 1))
    return (0, *inner, layers)


@pytest.mark.parametrize("seed", range(40))
def test_search_bounds_never_exceed_the_exact_cost(seed: int) -> None:
    rng = random.Random(seed)
    heads = rng.choice([4, 8])
    g = gpt_graph(layers=rng.randint(2, 8), hidden=heads * rng.choice([32, 64, 128]), heads=heads,
                  seq=rng.choice([64, 256, 1024]), vocab=rng.choice([512, 5000]))
    cluster = _cluster(rng)
    opts = _options(rng)
    batch = rng.choice([8, 16, 32, 64])
    rules = rules_function(g, default_tp_rules(g))
    ctx = make_context(g, cluster, global_batch=batch, rules=rules, options=opts)
    dtype = rng.choice(["bf16", "fp32"])
    cands, _ = enumerate_configs(g, ctx, Fixed(param_dtype=dtype), rules, None)
    checked = 0
    for cfg in rng.sample(cands, min(40, len(cands))):
        costs = ctx.costs(cfg.tp, ctx.micro(cfg), cfg.param_dtype, cfg.sp)
        tot = Totals(costs, None)
        tot.tied = tied_elements(ctx, cfg.tp)
        lb, mem_lb = bounds(ctx, cfg, tot)
        stages = cfg.pp * cfg.v
        cut_sets = []
        _, found = partition(SegmentModel(ctx, cfg, costs))
        if found:
            cut_sets.append(found)
        if stages < len(ctx.facts):
            cut_sets += [_random_cuts(rng, len(ctx.facts), stages) for _ in range(2)]
        for cuts in cut_sets:
            c = dataclasses.replace(cfg, cuts=cuts)
            c = dataclasses.replace(c, recompute=choose_recompute(ctx, c))
            b = evaluate(ctx, c)
            assert mem_lb <= max(b.memory_bytes) * (1 + 1e-9) + 1, (cfg, mem_lb, b.memory_bytes)
            if b.fits:
                assert lb <= b.step_time_s * (1 + 1e-9), (cfg, cuts, lb, b.step_time_s)
                checked += 1
    assert checked > 0
