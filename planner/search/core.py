"""The search: enumerate configurations, bound them, cut stages for the promising ones, cost them.

Order of work (all deterministic):

1. Enumerate every (mesh pp×dp×tp×ep, microbatches, schedule, data-parallel kind, sequence
   parallelism) that the constraints allow (``planner.search.candidates``).
2. Give each a lower bound on its step time (perfectly balanced stages, no recompute) and a lower
   bound on its memory (model states split evenly, everything recomputed). Memory-infeasible ones
   are dropped; the rest are visited in order of their bound.
3. Branch and bound: a configuration whose bound cannot beat the current ``top_k + 1`` best
   meshes (or its own mesh's best) is skipped; the first such bound ends the search.
4. Visited ones get stages from ``planner.search.partition``, recompute from
   ``evaluate.choose_recompute``, and their exact cost from ``evaluate.evaluate``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Union

from planner.cluster import Cluster
from planner.cost import CostOptions, LayerCost, layer_facts
from planner.cost_comm import group_all_reduce_time, group_reduce_scatter_time
from planner.cost_memory import DTYPE_BYTES, model_state_bytes
from planner.graph import ModelGraph
from planner.plan import PlanError
from planner.schedule_cost import in_flight, pipeline_time
from planner.schedule_kinds import KINDS
from planner.search.config import Breakdown, Config, Context
from planner.search.dp_cost import dp_bound_terms, dp_group, optimizer_time
from planner.search.evaluate import evaluate, stage_cuts_even
from planner.search.memory import choose_recompute, fsdp_buffer_terms
from planner.search.partition import SegmentModel, partition
from planner.search.result import Candidate, NoFeasiblePlan, SearchResult, build_plan, infeasible_message, loss_reason
from planner.search.candidates import enumerate_configs
from planner.search.space import Fixed, parse_constraints
from planner.search.tp import default_tp_rules
from planner.selectors import parse_selector

__all__ = ["run_search", "make_context", "fixed_cuts", "fixed_recompute", "fixed_selective"]

Progress = Callable[[int, int, "float | None"], None]
_DP_ORDER = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}



def captured_dtype(graph: ModelGraph) -> str:
    """The dtype most parameters were captured in (activations are assumed to match)."""
    counts: dict[str, int] = {}
    for dt in graph.param_dtypes.values():
        counts[dt] = counts.get(dt, 0) + 1
    name = max(sorted(counts), key=lambda k: counts[k]) if counts else "float32"
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, "fp32")


TPRules = Union[dict[str, str], Callable[[int], dict[str, str]]]


def rules_function(graph: ModelGraph, rules: TPRules | None) -> Callable[[int], dict[str, str]]:
    """tp degree -> the tensor-parallel rules to use at that degree (cached)."""
    if rules is None:
        rules = default_tp_rules(graph)
    if not callable(rules):
        fixed = dict(rules)
        return lambda tp: fixed
    cache: dict[int, dict[str, str]] = {}
    fn = rules

    def at(tp: int) -> dict[str, str]:
        if tp not in cache:
            cache[tp] = dict(fn(tp)) if tp > 1 else {}
        return cache[tp]
    return at


def make_context(graph: ModelGraph, cluster: Cluster, *, global_batch: int, rules: TPRules | None,
                 options: CostOptions | None) -> Context:
    """The search context; ``rules`` is a dict (the same rules at every tp) or a function of tp."""
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if graph.layers and not any(layer.flops_fwd or layer.flops_bwd for layer in graph.layers):
        raise ValueError("the graph carries no FLOPs, so every plan would cost nothing: capture it with "
                         "annotate=True (the default) before planning")
    at = rules_function(graph, rules)
    if options is None:  # CPU ranks run fairscale's runtime, so cost what it overlaps
        cpu = cluster.device.startswith("cpu") or cluster.name.startswith("cpu")
        options = CostOptions.for_runtime(cluster) if cpu else CostOptions()
    return Context(layer_facts(graph, {}), cluster, global_batch=global_batch, options=options,
                   captured_dtype=captured_dtype(graph), facts_for_tp=lambda tp: layer_facts(graph, at(tp)),
                   graph=graph)


def fixed_cuts(ctx: Context, stages: list[str]) -> tuple[int, ...]:
    """Stage selectors -> boundaries; each stage must be a contiguous run following the previous one."""
    names = [f.name for f in ctx.facts]
    cuts = [0]
    problems = []
    for k, text in enumerate(stages):
        sel = parse_selector(text)
        idx = [i for i, n in enumerate(names) if sel.matches(n)]
        if not idx:
            problems.append(f'stages[{k}].layers: "{text}" matches no layer')
            continue
        if idx[0] != cuts[-1] or idx[-1] - idx[0] + 1 != len(idx):
            problems.append(f'stages[{k}].layers: "{text}" must be the contiguous run of layers starting at layer '
                            f'{cuts[-1]} ({names[cuts[-1]] if cuts[-1] < len(names) else "end"})')
            continue
        cuts.append(idx[-1] + 1)
    if not problems and cuts[-1] != len(names):
        problems.append(f"stages: the stages end at layer {cuts[-1]}, but the model has {len(names)} layers")
    if problems:
        raise PlanError(problems, source="constraints")
    return tuple(cuts)


def fixed_recompute(ctx: Context, recompute: dict[str, str], kind: str = "full") -> frozenset[int]:
    """Recompute selectors -> indices of the layers recomputed with ``kind`` (full or selective;
    a later entry of another kind wins)."""
    names = [f.name for f in ctx.facts]
    chosen: set[int] = set()
    for text, k in recompute.items():
        sel = parse_selector(text)
        idx = {i for i, n in enumerate(names) if sel.matches(n)}
        if not idx and k != "none":
            raise PlanError([f'recompute["{text}"]: matches no whole layer; the cost model recomputes whole layers '
                             f"({names[0]} … {names[-1]})"], source="constraints")
        chosen = chosen | idx if k == kind else chosen - idx
    return frozenset(chosen)


def fixed_selective(ctx: Context, recompute: dict[str, str]) -> frozenset[int]:
    """Recompute selectors -> indices of selectively recomputed layers."""
    return fixed_recompute(ctx, recompute, "selective")


class _Totals:
    """Sums over one layer-cost list, for the lower bounds."""

    def __init__(self, costs: list[LayerCost], rec: frozenset[int] | None,
                 sel: frozenset[int] = frozenset()) -> None:
        if rec is not None:  # a fixed recompute set: fold it in, nothing more to recompute
            costs = _apply_recompute(costs, rec, sel)
        self.time = sum(c.fwd + c.bwd for c in costs)
        self.max_layer = max(c.fwd + c.bwd for c in costs)
        self.params = sum(c.params for c in costs)
        self.experts = sum(c.experts for c in costs)
        self.act = sum(c.act for c in costs)
        self.min_act = sum(min(c.act, c.act_recompute) for c in costs)
        self.rec_time = sum(c.fwd for c in costs if c.act > c.act_recompute)
        self.tied = 0.0  # elements of tied weights a sharded kind may keep whole (set by run_search)
        freed = self.act - self.min_act
        self.rho = self.rec_time / freed if freed > 0 else 0.0
        self._costs = costs
        self._buffers: dict[tuple[object, ...], tuple[float, float]] = {}

    def buffers(self, ctx: Context, cfg: Config) -> tuple[float, float]:
        key = (cfg.dp_kind, cfg.reshard, cfg.prefetch, cfg.dp, cfg.units, cfg.microbatches > 1)
        if key not in self._buffers:
            self._buffers[key] = fsdp_buffer_terms(ctx, cfg, self._costs)
        return self._buffers[key]


def fluid_bottleneck(tot: _Totals, flights: list[float], per_param: float, cap: float) -> float:
    """Lower estimate of the slowest rank's microbatch time when memory forces recompute.

    Relaxation: rank r takes a fraction x_r of the model (fractions, not whole layers; the model
    treated as uniform), so it holds ``x_r·(s·P + f_r·A)`` bytes (s = state bytes per parameter,
    f_r microbatches in flight) and must free the excess by recomputing at ``rho`` seconds per
    byte: ``t_r = x_r·T + rho·max(0, x_r·(s·P + f_r·A) - cap)/f_r``, at most everything. The
    smallest t with Σ_r x_r(t) >= 1 bounds the bottleneck from below for uniform layers. Ranks are
    grouped by in-flight count (rounded down to a power of two, which only loosens the bound).
    Returns inf when even full recompute cannot fit the model."""
    groups: dict[float, int] = {}
    for f in flights:
        key = float(2 ** int(math.log2(f))) if f >= 1 else f
        groups[key] = groups.get(key, 0) + 1
    T, P, A, A_min, rho = tot.time, tot.params, tot.act, tot.min_act, tot.rho
    rows = []
    for f, n in groups.items():
        full = per_param * P + f * A_min
        x_max = cap / full if full > 0 else math.inf
        mem = per_param * P + f * A
        x_free = cap / mem if mem > 0 else math.inf
        rows.append((n, f, x_max, x_free, mem))
    if sum(n * x_max for n, _, x_max, _, _ in rows) < 1.0:
        return math.inf

    def share(t: float) -> float:
        total = 0.0
        for n, f, x_max, x_free, mem in rows:
            x = t / T if T > 0 else math.inf
            if x > x_free:
                x = (t + rho * cap / f) / (T + rho * mem / f)
            total += n * min(x, x_max)
        return total

    lo, hi = T / len(flights), T + tot.rec_time
    if share(hi) < 1.0:
        return math.inf
    for _ in range(30):
        mid = (lo + hi) / 2
        if share(mid) >= 1.0:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-4 * hi:
            break
    return lo


def run_search(graph: ModelGraph, cluster: Cluster, *, global_batch: int, constraints: object = None,
               top_k: int = 3, progress: Progress | None = None, tp_rules: TPRules | None = None,
               options: CostOptions | None = None) -> SearchResult:
    start = time.perf_counter()
    fixed = parse_constraints(constraints)  # type: ignore[arg-type]
    if fixed.global_batch is not None and fixed.global_batch != global_batch:
        raise PlanError([f"schedule.global_batch: the constraints were made for a global batch of "
                         f"{fixed.global_batch}, but the search is for {global_batch}; drop it or search for "
                         f"{fixed.global_batch}"], source="constraints")
    rules = rules_function(graph, fixed.tp_rules if fixed.tp_rules is not None else tp_rules)
    ctx = make_context(graph, cluster, global_batch=global_batch, rules=rules, options=options)
    cuts = fixed_cuts(ctx, fixed.stages) if fixed.stages else None
    rec = fixed_recompute(ctx, fixed.recompute) if fixed.recompute is not None else None
    sel = fixed_selective(ctx, fixed.recompute) if fixed.recompute is not None else frozenset()
    cands, notes = enumerate_configs(graph, ctx, fixed, rules, cuts)
    if not cands:
        raise PlanError(["no configuration satisfies the constraints: " + "; ".join(notes or ["(none enumerated)"])],
                        source="search")
    totals: dict[tuple[int, int, str, bool], _Totals] = {}
    bounded: list[tuple[float, tuple[object, ...], Config, float]] = []
    mem_fail: list[tuple[float, Config]] = []
    for cfg in cands:
        key = (cfg.tp, ctx.micro(cfg), cfg.param_dtype, cfg.sp)
        if key not in totals:
            totals[key] = _Totals(ctx.costs(*key), rec, sel)
            totals[key].tied = _tied_elements(ctx, cfg.tp)
        lb, mem_lb = _bounds(ctx, cfg, totals[key])
        if mem_lb > ctx.cap or math.isinf(lb):
            mem_fail.append((mem_lb - ctx.cap, cfg))
            continue
        order: tuple[object, ...] = (KINDS[cfg.kind].order, _DP_ORDER[cfg.dp_kind], not cfg.reshard, cfg.sp, cfg.microbatches, cfg.v,
                 cfg.pp, cfg.tp)
        bounded.append((lb, order, cfg, mem_lb))
    bounded.sort(key=lambda x: (x[0], x[1]))
    keep = top_k + 1
    best: dict[tuple[int, int, int], tuple[float, tuple[object, ...], Breakdown]] = {}
    closest: Breakdown | None = None
    evaluated = 0
    total = len(cands)
    for n, (lb, order, cfg, _) in enumerate(bounded):  # noqa: B007 - order is the tie-break key
        times = sorted(v[0] for v in best.values())
        threshold = times[keep - 1] if len(times) >= keep else float("inf")
        if lb >= threshold:
            break
        mesh = (cfg.pp, cfg.dp, cfg.tp)
        if mesh in best and lb >= best[mesh][0]:
            continue
        if progress is not None and n % 64 == 0:
            progress(n, len(bounded), times[0] if times else None)
        evaluated += 1
        b = _cost(ctx, cfg, cuts, rec, sel)
        if b is None:
            continue
        if not b.fits:
            if closest is None or b.shortfall < closest.shortfall:
                closest = b
            continue
        if mesh not in best or (b.step_time_s, order) < best[mesh][:2]:
            best[mesh] = (b.step_time_s, order, b)
    if progress is not None:
        progress(len(bounded), len(bounded), min((v[0] for v in best.values()), default=None))
    if not best:
        closest = _closest(ctx, mem_fail, closest, cuts, rec, sel)
        fixes = _fixed_notes(fixed)
        offloaded = None
        if not fixed.offload and fixed.dp_kind in (None, "fsdp") and isinstance(constraints, (dict, type(None))):
            try:
                with_offload = dict(constraints or {})
                with_offload["data_parallel"] = {**with_offload.get("data_parallel", {}), "kind": "fsdp",
                                                 "offload": True}
                offloaded = run_search(graph, cluster, global_batch=global_batch, constraints=with_offload,
                                       top_k=0, tp_rules=tp_rules, options=options).best
            except PlanError:
                offloaded = None
        msg, short = infeasible_message(ctx, closest, total_params=graph.num_parameters,
                                        param_dtype=fixed.param_dtype or "fp32", fixed_notes=fixes,
                                        offloaded=offloaded)
        raise NoFeasiblePlan(msg, shortfall_bytes=short)
    ranked = sorted(best.values(), key=lambda v: (v[0], v[1]))[: top_k + 1]
    win = ranked[0][2]
    out = []
    for t, _, b in ranked:
        assert b.config is not None
        plan = build_plan(graph, ctx, b.config, b, tp_rules=rules(b.config.tp), units=fixed.units)
        out.append(Candidate(plan=plan, breakdown=b, reason="" if b is win else loss_reason(b, win)))
    return SearchResult(best=out[0], runners_up=out[1:], considered=total, evaluated=evaluated,
                        elapsed_s=time.perf_counter() - start)


def _cost(ctx: Context, cfg: Config, cuts: tuple[int, ...] | None, rec: frozenset[int] | None,
          sel: frozenset[int] = frozenset()) -> Breakdown | None:
    """Cut, choose recompute, cost. None when no cut fits (the segment model says so)."""
    costs = ctx.costs(cfg.tp, ctx.micro(cfg), cfg.param_dtype, cfg.sp)
    if cuts is None:
        model = SegmentModel(ctx, cfg, _apply_recompute(costs, rec, sel) if rec is not None else costs)
        bottleneck, found = partition(model)
        if not found:
            return None
        cuts = found
    cfg = dataclasses.replace(cfg, cuts=cuts, selective=sel)
    cfg = dataclasses.replace(cfg, recompute=rec if rec is not None else choose_recompute(ctx, cfg))
    return evaluate(ctx, cfg)





def _tied_elements(ctx: Context, tp: int) -> float:
    """Elements (after the tp split) of the tied weights: at most these stay whole on dp."""
    owners: dict[int, float] = {}
    for f in ctx.facts_for(tp):
        for owner, count in f.tied:
            owners[owner] = max(owners.get(owner, 0.0), count / (tp if f.tp.sharded and tp > 1 else 1))
    return sum(owners.values())


def _apply_recompute(costs: list[LayerCost], rec: frozenset[int], sel: frozenset[int] = frozenset()) -> list[LayerCost]:
    """Costs with a fixed recompute map (full ``rec``, selective ``sel``) folded in, and no further
    recompute possible."""
    out = []
    for i, c in enumerate(costs):
        if i in rec:
            c = dataclasses.replace(c, bwd=c.bwd + c.fwd, act=c.act_recompute)
        elif i in sel:
            c = dataclasses.replace(c, bwd=c.bwd + c.rec_selective, act=c.act_selective)
        out.append(dataclasses.replace(c, act_recompute=c.act))
    return out


def _closest(ctx: Context, mem_fail: list[tuple[float, Config]], closest: Breakdown | None,
             cuts: tuple[int, ...] | None, rec: frozenset[int] | None,
             sel: frozenset[int] = frozenset()) -> Breakdown | None:
    """Exact shortfall of the configurations whose memory bound failed by the least."""
    L = len(ctx.facts)
    for _, cfg in sorted(mem_fail, key=lambda x: x[0])[:8]:
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


def _fixed_notes(fixed: Fixed) -> list[str]:
    notes = []
    if fixed.recompute is not None:
        notes.append("let the planner recompute (the constraints fix the recompute map)")
    if fixed.dp_kind is not None and fixed.dp_kind != "fsdp":
        notes.append(f'shard states with data_parallel.kind "fsdp" (the constraints fix "{fixed.dp_kind}")')
    if fixed.tp is not None or fixed.pp is not None:
        notes.append("let the planner choose mesh.tp / mesh.pp (the constraints fix them)")
    return notes


def _bounds(ctx: Context, cfg: Config, tot: _Totals) -> tuple[float, float]:
    """(lower bound on step time, lower bound on the fullest rank's memory).

    Time: the bottleneck rank's microbatch time is at least the fluid bound (memory-forced
    recompute) and its share of the data-parallel traffic; the ranks' times sum to at least the
    whole model's; the schedule's closed form is monotone in both, so a vector with that bottleneck
    and that sum bounds the pipeline from below. After it, the optimizer step of an average rank
    (the slowest is slower), and with one pipeline rank (nothing to hide behind) the gradient
    reduction that does not overlap compute. Every collective is counted once with its bytes:
    buckets and units only add latencies. ``test_search_bounds`` checks the bound against
    :func:`evaluate` on random configurations."""
    pp, m, v = cfg.pp, cfg.microbatches, cfg.v
    o = ctx.options
    per_param = model_state_bytes(1.0, dp_kind=cfg.dp_kind, dp=cfg.dp, param_dtype=cfg.param_dtype,
                                  optimizer=o.optimizer)
    params = tot.params / pp
    if cfg.ep > 1 and tot.experts:  # split over ep, kept whole on dp: an average state cost per element
        whole = model_state_bytes(1.0 / cfg.ep, dp_kind="ddp", dp=cfg.dp, param_dtype=cfg.param_dtype,
                                  optimizer=o.optimizer)
        share = tot.experts / tot.params
        per_param = (1 - share) * per_param + share * whole
    state_per_param = per_param
    if cfg.offload:  # states on the host: the device holds none, the host must hold a rank's share
        per_param = 0.0
        if state_per_param * params > ctx.host_cap:
            return math.inf, ctx.cap * 1.0000001
    # what the dp axis gathers and reduces: no tied weight a sharded kind keeps whole, no expert
    dp_params = max(0.0, tot.params - tot.tied - (tot.experts if cfg.ep > 1 else 0.0)) / pp
    extra, fixed_bytes = tot.buffers(ctx, cfg)
    mem_lb = (per_param + extra) * params + tot.min_act / pp + fixed_bytes
    flights = [in_flight(cfg.kind, pp, m, r, v=v) for r in range(pp)]
    t = max(tot.max_layer, fluid_bottleneck(tot, flights, per_param + extra, ctx.cap * _FLUID_SLACK - fixed_bytes))
    if math.isinf(t):
        return t, max(mem_lb, ctx.cap * 1.0000001)
    mean = tot.time / pp
    comm, overlapped = dp_bound_terms(ctx, cfg, dp_params)
    if overlapped:
        t, mean = max(t, comm), max(mean, comm)
    else:
        t, mean = max(t, mean + comm), mean + comm
    t = max(t, mean)
    rest = (pp * mean - t) / (pp - 1) if pp > 1 else 0.0
    pipe = pipeline_time(cfg.kind, [t] + [rest] * (pp - 1), m, v=v)
    share = ctx.cluster.core_share
    if share > 1.0:  # ranks time-sharing cores: see evaluate.shared_core_pipeline_time
        pipe = max(pipe / share, m * mean)
    tail = optimizer_time(ctx, cfg, state_per_param * params)
    if pp == 1 and cfg.dp > 1 and not o.overlap_dp:
        g = dp_group(ctx, cfg)
        grads, weights = dp_params * DTYPE_BYTES[cfg.reduce_dtype], dp_params * DTYPE_BYTES[cfg.param_dtype]
        once = o.accumulate_unsharded or m == 1
        if cfg.dp_kind == "ddp":
            tail += group_all_reduce_time(g, grads)
        elif cfg.dp_kind in ("zero1", "zero2"):
            tail += group_reduce_scatter_time(g, weights)  # the parameter all-gather after the step
            if cfg.dp_kind == "zero1" or once:
                tail += group_reduce_scatter_time(g, grads)
        elif cfg.dp_kind == "fsdp" and o.accumulate_unsharded:
            tail += group_reduce_scatter_time(g, grads)
    return pipe + tail, mem_lb


# The fluid bound ignores the discreteness of layers; give it 2% more memory than the cap so that
# a heterogeneous mix (embedding, head) cannot make it overshoot the true optimum.
_FLUID_SLACK = 1.02
