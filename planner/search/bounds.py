"""Lower bounds for branch and bound: no stage cut, recompute choice or overlap can do better.

:func:`bounds` gives, for a configuration without cuts, a lower bound on its step time and on its
fullest rank's memory; ``planner.search.core`` skips every configuration whose bound cannot beat
the plans already found. A bound above the exact cost would lose the best plan, so each term is
argued in its docstring and ``tests/planner/test_search_bounds.py`` checks bound <= exact on
random configurations.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from planner.cost import LayerCost
from planner.cost_comm import group_all_gather_time, group_all_reduce_time, group_reduce_scatter_time
from planner.cost_memory import DTYPE_BYTES, model_state_bytes, stepped_elements
from planner.schedule_cost import in_flight, pipeline_time
from planner.search.config import Config, Context
from planner.search.dp_cost import dp_bound_terms, dp_group, optimizer_time
from planner.search.memory import fsdp_buffer_terms

__all__ = ["Totals", "bounds", "fluid_bottleneck", "tied_elements", "apply_recompute"]


class Totals:
    """Sums over one layer-cost list, for the lower bounds."""

    def __init__(self, costs: list[LayerCost], rec: frozenset[int] | None,
                 sel: frozenset[int] = frozenset()) -> None:
        if rec is not None:  # a fixed recompute set: fold it in, nothing more to recompute
            costs = apply_recompute(costs, rec, sel)
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
        self._buffers: dict[tuple[object, ...], tuple[float, float, float, float]] = {}

    def buffers(self, ctx: Context, cfg: Config) -> tuple[float, float, float, float]:
        # what fsdp_buffer_terms reads: the dp degree only as "more than one"
        key = (cfg.dp_kind, cfg.reshard, cfg.prefetch, cfg.dp > 1, cfg.offload, cfg.units, cfg.microbatches > 1,
               cfg.param_dtype, cfg.reduce_dtype)
        if key not in self._buffers:
            self._buffers[key] = fsdp_buffer_terms(ctx, cfg, self._costs)
        return self._buffers[key]


@functools.lru_cache(maxsize=4096)
def flight_groups(kind: str, pp: int, m: int, v: int) -> tuple[tuple[float, int], ...]:
    """The pipeline ranks' microbatches in flight, grouped: (count rounded down to a power of two,
    ranks) (see :func:`fluid_bottleneck`). Per schedule shape; 384 ranks deep on a 3072-GPU mesh."""
    groups: dict[float, int] = {}
    for r in range(pp):
        f = in_flight(kind, pp, m, r, v=v)
        key = float(2 ** int(math.log2(f))) if f >= 1 else f
        groups[key] = groups.get(key, 0) + 1
    return tuple(groups.items())


def fluid_bottleneck(tot: Totals, groups: tuple[tuple[float, int], ...], per_param: float, cap: float) -> float:
    """Lower estimate of the slowest rank's microbatch time when memory forces recompute.

    Relaxation: rank r takes a fraction x_r of the model (fractions, not whole layers; the model
    treated as uniform), so it holds ``x_r·(s·P + f_r·A)`` bytes (s = state bytes per parameter,
    f_r microbatches in flight) and must free the excess by recomputing at ``rho`` seconds per
    byte: ``t_r = x_r·T + rho·max(0, x_r·(s·P + f_r·A) - cap)/f_r``, at most everything. The
    smallest t with Σ_r x_r(t) >= 1 bounds the bottleneck from below for uniform layers. Ranks are
    grouped by in-flight count (rounded down to a power of two, which only loosens the bound):
    ``groups`` is :func:`flight_groups`. Returns inf when even full recompute cannot fit the model."""
    T, P, A, A_min, rho = tot.time, tot.params, tot.act, tot.min_act, tot.rho
    rows = []
    for f, n in groups:
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

    lo, hi = T / sum(n for _, n in groups), T + tot.rec_time
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


def tied_elements(ctx: Context, tp: int) -> float:
    """Elements (after the tp split) of the tied weights: at most these stay whole on dp."""
    owners: dict[int, float] = {}
    for f in ctx.facts_for(tp):
        for owner, count in f.tied:
            owners[owner] = max(owners.get(owner, 0.0), count / (tp if f.tp.sharded and tp > 1 else 1))
    return sum(owners.values())


def apply_recompute(costs: list[LayerCost], rec: frozenset[int], sel: frozenset[int] = frozenset()) -> list[LayerCost]:
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


def bounds(ctx: Context, cfg: Config, tot: Totals) -> tuple[float, float]:
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
    stepped_per_param = stepped_elements(1.0, dp_kind=cfg.dp_kind, dp=cfg.dp)
    if cfg.ep > 1 and tot.experts:  # split over ep, kept whole on dp: an average state cost per element
        whole = model_state_bytes(1.0 / cfg.ep, dp_kind="ddp", dp=cfg.dp, param_dtype=cfg.param_dtype,
                                  optimizer=o.optimizer)
        share = tot.experts / tot.params
        per_param = (1 - share) * per_param + share * whole
        stepped_per_param = (1 - share) * stepped_per_param + share / cfg.ep
    state_per_param = per_param
    if cfg.offload:  # states on the host: the device holds none, the host must hold a rank's share
        per_param = 0.0
        if state_per_param * params > ctx.host_cap:
            return math.inf, ctx.cap * 1.0000001
    # what the dp axis gathers and reduces: no tied weight a sharded kind keeps whole, no expert
    dp_params = max(0.0, tot.params - tot.tied - (tot.experts if cfg.ep > 1 else 0.0)) / pp
    extra, _, unit, beyond = tot.buffers(ctx, cfg)
    fixed_bytes, floor = unit * beyond, 0.0
    if pp > 1 and unit:  # a rank may hold a single unit: only the one holding the largest is known to gather it
        floor = unit * (beyond + per_param + extra)
        fixed_bytes = 0.0
    mem_lb = max((per_param + extra) * params + tot.min_act / pp + fixed_bytes, floor)
    groups = flight_groups(cfg.kind, pp, m, v)
    t = max(tot.max_layer, fluid_bottleneck(tot, groups, per_param + extra, ctx.cap * _FLUID_SLACK - fixed_bytes))
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
    tail = optimizer_time(ctx, cfg, stepped_per_param * params)
    if pp == 1 and cfg.dp > 1 and not o.overlap_dp:
        g = dp_group(ctx, cfg)
        grads, weights = dp_params * DTYPE_BYTES[cfg.reduce_dtype], dp_params * DTYPE_BYTES[cfg.param_dtype]
        once = o.accumulate_unsharded or m == 1
        if cfg.dp_kind == "ddp":
            tail += group_all_reduce_time(g, grads)
        elif cfg.dp_kind in ("zero1", "zero2"):
            tail += group_all_gather_time(g, weights)  # the parameter all-gather after the step
            if cfg.dp_kind == "zero1" or once:
                tail += group_reduce_scatter_time(g, grads)
        elif cfg.dp_kind == "fsdp" and o.accumulate_unsharded:
            tail += group_reduce_scatter_time(g, grads)
    return pipe + tail, mem_lb


# The fluid bound ignores the discreteness of layers; give it 2% more memory than the cap so that
# a heterogeneous mix (embedding, head) cannot make it overshoot the true optimum.
_FLUID_SLACK = 1.02
