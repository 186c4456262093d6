"""When nothing fits: the closest configuration, what the constraints ruled out, and whether CPU
offload would fit, without a second search (a few configurations are costed with offload instead)."""

from __future__ import annotations

import dataclasses

from planner.graph import ModelGraph
from planner.search.config import Breakdown, Config, Context
from planner.search.evaluate import evaluate, stage_cuts_even
from planner.search.partition import cut_and_cost
from planner.search.result import Candidate, NoFeasiblePlan, build_plan, infeasible_message
from planner.search.space import Fixed

__all__ = ["no_feasible_plan"]

_PROBES = 8
"""Configurations (closest to fitting first) costed again with FSDP CPU offload for the message."""


def no_feasible_plan(ctx: Context, graph: ModelGraph, fixed: Fixed, mem_fail: list[tuple[float, Config]],
                     closest: Breakdown | None, cuts: tuple[int, ...] | None, rec: frozenset[int] | None,
                     sel: frozenset[int]) -> NoFeasiblePlan:
    """The error to raise: the smallest shortfall and the fixes, including an offloaded plan that fits."""
    closest = _closest(ctx, mem_fail, closest, cuts, rec, sel)
    offloaded = None
    if not fixed.offload and fixed.dp_kind in (None, "fsdp"):
        offloaded = _offload_probe(ctx, graph, mem_fail, closest, cuts, rec, sel)
    msg, short = infeasible_message(ctx, closest, total_params=graph.num_parameters,
                                    param_dtype=fixed.param_dtype or "fp32", fixed_notes=_fixed_notes(fixed),
                                    offloaded=offloaded)
    return NoFeasiblePlan(msg, shortfall_bytes=short)


def _closest(ctx: Context, mem_fail: list[tuple[float, Config]], closest: Breakdown | None,
             cuts: tuple[int, ...] | None, rec: frozenset[int] | None, sel: frozenset[int]) -> Breakdown | None:
    """Exact shortfall of the configurations whose memory bound failed by the least."""
    L = len(ctx.facts)
    for _, cfg in sorted(mem_fail, key=lambda x: x[0])[:_PROBES]:
        stages = cfg.pp * cfg.v
        if stages > L:
            continue
        c = dataclasses.replace(cfg, cuts=cuts or stage_cuts_even(L, stages))
        costs = ctx.costs(c.tp, ctx.micro(c), c.param_dtype, c.sp)
        all_rec = frozenset(i for i, x in enumerate(costs) if x.act > x.act_recompute)
        b = evaluate(ctx, dataclasses.replace(c, recompute=rec if rec is not None else all_rec, selective=sel))
        if closest is None or b.shortfall < closest.shortfall:
            closest = b
    return closest


def _offload_probe(ctx: Context, graph: ModelGraph, mem_fail: list[tuple[float, Config]], closest: Breakdown | None,
                   cuts: tuple[int, ...] | None, rec: frozenset[int] | None,
                   sel: frozenset[int]) -> Candidate | None:
    """The fastest of a few near-fitting configurations moved to FSDP with CPU offload, if one fits."""
    tried: list[Config] = [closest.config] if closest is not None and closest.config is not None else []
    tried += [cfg for _, cfg in sorted(mem_fail, key=lambda x: x[0])[:_PROBES]]
    best: Breakdown | None = None
    seen: set[Config] = set()
    for cfg in tried:
        c = dataclasses.replace(cfg, dp_kind="fsdp", offload=True, reshard=True, cuts=(), recompute=frozenset())
        if c in seen:
            continue
        seen.add(c)
        b = cut_and_cost(ctx, c, cuts, rec, sel)
        if b is not None and b.fits and (best is None or b.step_time_s < best.step_time_s):
            best = b
    if best is None or best.config is None:
        return None
    plan = build_plan(graph, ctx, best.config, best, tp_rules={}, units=best.config.units)
    return Candidate(plan=plan, breakdown=best)


def _fixed_notes(fixed: Fixed) -> list[str]:
    notes = []
    if fixed.recompute is not None:
        notes.append("let the planner recompute (the constraints fix the recompute map)")
    if fixed.dp_kind is not None and fixed.dp_kind != "fsdp":
        notes.append(f'shard states with data_parallel.kind "fsdp" (the constraints fix "{fixed.dp_kind}")')
    if fixed.tp is not None or fixed.pp is not None:
        notes.append("let the planner choose mesh.tp / mesh.pp (the constraints fix them)")
    return notes
