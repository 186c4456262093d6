"""Cut layers into pipeline stages: minimize the slowest stage under the memory cap.

A *segment* is a contiguous run of layers ``[s, e)`` placed as stage ``k``. Its time is the
forward + backward of its layers for one microbatch, plus the recompute it needs to fit (the
cheapest number of its recomputable layers, assuming they are alike, as repeated blocks are),
plus its pipeline sends and exposed FSDP traffic; it is infinite when even recomputing everything
does not fit. Both the time and the infeasibility only grow when a segment grows, which is what
makes the two exact algorithms below correct:

* :func:`partition_dp`: dynamic programming, ``best[k][e] = min_s max(best[k-1][s], seg(s, e, k-1))``,
  O(S·L²) segment evaluations. Used when that is small, and as the reference in tests.
* :func:`partition_fast`: bisection on the bottleneck ``T`` with a greedy feasibility check
  (each stage takes the longest run that fits in ``T``; with monotone segment costs this covers
  the longest possible prefix, so it succeeds iff some partition has bottleneck <= T), each stage
  end found by binary search: O(S·log L) per check. It returns a bottleneck within ``rel_tol`` of
  the optimum.

Stage ``k`` runs on pipeline rank ``k % pp`` (interleaved chunks; the V schedule places the second
half back up, ``planner.schedule_cost.stage_placement``) and each rank's memory cap is shared
evenly by its ``v`` chunks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from planner.cost import LayerCost
from planner.cost_memory import model_state_bytes
from planner.schedule_cost import in_flight, stage_placement
from planner.search.bounds import apply_recompute
from planner.search.config import Breakdown, Config, Context
from planner.search.dp_cost import dp_bound_affine
from planner.search.expert_cost import expert_comm, expert_matmul_extra
from planner.search.evaluate import evaluate
from planner.search.memory import choose_recompute, fsdp_buffer_terms
from planner.search.ranks import stage_send

__all__ = ["SegmentModel", "partition_dp", "partition_fast", "partition", "cut_and_cost"]

INF = math.inf
_BIG = 1e300  # any finite segment time
SegFn = Callable[[int, int, int], float]


@dataclass
class _Prefix:
    t: list[float]
    f: list[float]
    save: list[float]
    act: list[float]
    n: list[int]
    params: list[float]


def _prefix(values: list[float]) -> list[float]:
    out = [0.0]
    for x in values:
        out.append(out[-1] + x)
    return out


class SegmentModel:
    """O(1) segment times for one configuration (everything but its cuts and recompute set)."""

    def __init__(self, ctx: Context, cfg: Config, costs: list[LayerCost]) -> None:
        self.ctx, self.cfg, self.costs = ctx, cfg, costs
        self.L = len(costs)
        self.S = cfg.pp * cfg.v
        gain = [max(0.0, c.act - c.act_recompute) for c in costs]
        recomputable = [g > 0 for g in gain]
        self.per_param = model_state_bytes(1.0, dp_kind=cfg.dp_kind, dp=cfg.dp, param_dtype=cfg.param_dtype,
                                           optimizer=ctx.options.optimizer)
        # expert parallelism: a layer's experts are E/ep of them kept whole on dp, so their states
        # cost ddp/ep per element instead of the kind's; count them as that many plain elements
        a2a = [expert_comm(ctx, cfg, costs, [i])[0] + expert_matmul_extra(ctx, cfg, costs, [i])
               for i in range(len(costs))]
        ratio = model_state_bytes(1.0 / cfg.ep, dp_kind="ddp", dp=cfg.dp, param_dtype=cfg.param_dtype,
                                  optimizer=ctx.options.optimizer) / self.per_param if cfg.ep > 1 else 1.0
        eq = [c.params - c.experts + c.experts * ratio if cfg.ep > 1 else c.params for c in costs]
        self.p = _Prefix(t=_prefix([c.fwd + c.bwd + a for c, a in zip(costs, a2a)]),
                         f=_prefix([c.fwd if r else 0.0 for c, r in zip(costs, recomputable)]),
                         save=_prefix(gain), act=_prefix([c.act for c in costs]),
                         n=[int(x) for x in _prefix([1.0 if r else 0.0 for r in recomputable])],
                         params=_prefix(eq))
        tp = cfg.tp
        facts = ctx.facts_for(tp)
        self.tied = [(i, o, n / (tp if f.tp.sharded and tp > 1 else 1)) for i, f in enumerate(facts) for o, n in f.tied]
        self.flight = [in_flight(cfg.kind, cfg.pp, cfg.microbatches, r, v=cfg.v) for r in range(cfg.pp)]
        self.placement = stage_placement(cfg.kind, cfg.pp, cfg.v)
        self.transient = max((c.act for c, r in zip(costs, recomputable) if r), default=0.0)
        self.host_per_param = 0.0
        if cfg.offload:  # states live on the host; the device keeps only unshard buffers
            self.host_per_param, self.per_param = self.per_param, 0.0
        extra, self.buffers, _, _ = fsdp_buffer_terms(ctx, cfg, costs)
        self.per_param += extra
        self.cap = ctx.cap / cfg.v
        self.sends = [0.0 if ctx.options.overlap_p2p else stage_send(ctx, cfg, c.output)[0] for c in costs]
        self.comm0, self.comm1, self.overlapped = dp_bound_affine(ctx, cfg)

        # per stage: microbatches in flight, and whether it sends to / receives from another rank
        self.stage_flight = [self.flight[self.placement[k]] for k in range(self.S)]
        self.sends_out = [k + 1 < self.S and self.placement[k + 1] != self.placement[k] for k in range(self.S)]
        self.sends_in = [k > 0 and self.placement[k - 1] != self.placement[k] for k in range(self.S)]
        self.fixed = self.buffers / cfg.v
        self.host_cap = ctx.host_cap

    def params(self, s: int, e: int) -> float:
        total = self.p.params[e] - self.p.params[s]
        if self.tied:
            seen: set[int] = set()
            for i, owner, n in self.tied:
                if s <= i < e and owner < s and owner not in seen:
                    seen.add(owner)
                    total += n
        return total

    def time(self, s: int, e: int, k: int) -> float:
        """Seconds of segment [s, e) as stage k for one microbatch, or inf if it cannot fit."""
        p = self.p
        flight = self.stage_flight[k]
        params = self.params(s, e)
        if self.host_per_param and self.host_per_param * params > self.host_cap:
            return INF
        mem = self.per_param * params + flight * (p.act[e] - p.act[s]) + self.fixed
        t = p.t[e] - p.t[s]
        if mem > self.cap:
            n = p.n[e] - p.n[s]
            if n == 0:
                return INF
            need = mem + self.transient - self.cap
            per_layer = flight * (p.save[e] - p.save[s]) / n
            count = math.ceil(need / per_layer - 1e-9) if per_layer > 0 else n + 1
            if count > n:
                return INF
            t += count * (p.f[e] - p.f[s]) / n
        if self.sends_out[k]:
            t += self.sends[e - 1]
        if self.sends_in[k]:
            t += self.sends[s - 1]
        if self.comm1 and params > 0:  # FSDP gathers / ZeRO-2 reduce-scatters of the segment, one collective each
            comm = self.comm0 + self.comm1 * params
            t = max(t, comm) if self.overlapped else t + comm
        return t


def partition_dp(seg: SegFn, n_layers: int, stages: int) -> tuple[float, tuple[int, ...]]:
    """Exact min-max partition of ``n_layers`` into ``stages`` non-empty runs by dynamic programming.
    Returns (bottleneck seconds, cuts); (inf, ()) when no partition fits."""
    L, S = n_layers, stages
    if S > L:
        return INF, ()
    best = [[INF] * (L + 1) for _ in range(S + 1)]
    arg = [[0] * (L + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for k in range(1, S + 1):
        for e in range(k, L - (S - k) + 1):
            b, a = INF, 0
            for s in range(k - 1, e):
                if best[k - 1][s] >= b:
                    continue
                val = max(best[k - 1][s], seg(s, e, k - 1))
                if val < b:
                    b, a = val, s
            best[k][e], arg[k][e] = b, a
    if best[S][L] == INF:
        return INF, ()
    cuts = [L]
    for k in range(S, 0, -1):
        cuts.append(arg[k][cuts[-1]])
    return best[S][L], tuple(reversed(cuts))


def _greedy(seg: SegFn, L: int, S: int, limit: float) -> tuple[float, tuple[int, ...] | None]:
    """Each stage in turn takes as many layers as fit under ``limit``. Returns (the worst segment,
    the cuts) when that places all ``L`` layers on ``S`` stages; else (the least segment time above
    ``limit`` met on the way, None): the greedy packs the same way, and fails, under every limit
    below it (segment times grow with the segment), so the optimum is at least that."""
    cap = min(limit, _BIG)
    cuts = [0]
    worst, above = 0.0, INF
    s = 0
    for k in range(S):
        lo, hi = s + 1, L - (S - k - 1)
        if lo > hi:
            return above, None
        first = seg(s, lo, k)
        if not first <= cap:
            return min(above, first), None
        top = hi
        while lo < hi:  # largest e in [lo, hi] with seg(s, e, k) <= limit (and finite)
            mid = (lo + hi + 1) // 2
            if seg(s, mid, k) <= cap:
                lo = mid
            else:
                hi = mid - 1
        worst = max(worst, seg(s, lo, k))
        if lo < top:  # one more layer would have exceeded the limit
            above = min(above, seg(s, lo + 1, k))
        cuts.append(lo)
        s = lo
    return (worst, tuple(cuts)) if s == L else (above, None)


def partition_fast(seg: SegFn, n_layers: int, stages: int, *, lower: float = 0.0,
                   rel_tol: float = 1e-4) -> tuple[float, tuple[int, ...]]:
    """Min-max partition by bisection on the bottleneck with a greedy check; the bottleneck is
    within ``rel_tol`` of the optimum. ``lower`` is any lower bound (e.g. total time / stages). A
    failed check raises the lower bound to the least segment time that could change the greedy's
    packing, so the bisection mostly ends on the optimum itself in a few steps."""
    if stages > n_layers:
        return INF, ()
    hi, cuts = _greedy(seg, n_layers, stages, INF)
    if cuts is None:
        return INF, ()
    lo = lower
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        got, found = _greedy(seg, n_layers, stages, mid)
        if found is None:
            lo = max(mid, min(got, hi))
        else:
            hi, cuts = got, found
    return hi, cuts


def _last_fit(seg: SegFn, s: int, lo: int, hi: int, k: int, limit: float) -> int:
    """Largest e in [lo, hi] with seg(s, e, k) <= limit (lo - 1 if none)."""
    if lo > hi or not seg(s, lo, k) <= limit:
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if seg(s, mid, k) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _first_start(seg: SegFn, e: int, lo: int, k: int, limit: float) -> int:
    """Smallest s in [lo, e-1] with seg(s, e, k) <= limit (e if none)."""
    hi = e - 1
    if hi < lo or not seg(hi, e, k) <= limit:
        return e
    while lo < hi:
        mid = (lo + hi) // 2
        if seg(mid, e, k) <= limit:
            hi = mid
        else:
            lo = mid + 1
    return lo


def balanced_cuts(seg: SegFn, prefix: list[float], n_layers: int, stages: int, limit: float) -> tuple[int, ...] | None:
    """Among the cuts whose every stage takes at most ``limit`` (the optimal bottleneck), the one
    whose stage ends stay closest to the even split of the total time (``prefix``: cumulative
    layer times). Min-max alone leaves every stage but the slowest free, and a greedy fill then
    packs the first stages to the limit and leaves the last layers (a final norm, the head) alone on
    stages of their own; this keeps them with their neighbours. O(S·log L) segment evaluations:
    a backward greedy gives, per stage, the earliest end from which the rest still fits."""
    L, S = n_layers, stages
    limit = min(limit * (1 + 1e-9), _BIG)
    earliest = [L] * (S + 1)  # earliest[k]: the smallest start from which stages k..S-1 can cover the rest
    for k in range(S - 1, -1, -1):
        start = _first_start(seg, earliest[k + 1], k, k, limit)
        if start >= earliest[k + 1]:
            return None
        earliest[k] = start
    if earliest[0] != 0:
        return None
    cuts, s, total = [0], 0, prefix[L]
    for k in range(S - 1):
        lo = max(s + 1, earliest[k + 1])
        hi = _last_fit(seg, s, lo, L - (S - k - 1), k, limit)
        if hi < lo:
            return None
        target = total * (k + 1) / S
        e = min(range(lo, hi + 1), key=lambda x: (abs(prefix[x] - target), x)) if hi - lo < 64 else \
            _closest_index(prefix, target, lo, hi)
        cuts.append(e)
        s = e
    cuts.append(L)
    return tuple(cuts)


def _closest_index(prefix: list[float], target: float, lo: int, hi: int) -> int:
    """Index in [lo, hi] whose prefix value is closest to ``target`` (prefix is non-decreasing)."""
    a, b = lo, hi
    while a < b:
        mid = (a + b) // 2
        if prefix[mid] < target:
            a = mid + 1
        else:
            b = mid
    return min((x for x in (a - 1, a) if lo <= x <= hi), key=lambda x: (abs(prefix[x] - target), x))


def partition(model: SegmentModel, *, exact_limit: int = 20_000) -> tuple[float, tuple[int, ...]]:
    """Best cuts for ``model``: the optimal bottleneck (exact DP when S·L² <= exact_limit, else
    bisection), then the most even cuts that keep it (:func:`balanced_cuts`)."""
    L, S = model.L, model.S
    if S == 1:
        t = model.time(0, L, 0)
        return t, ((0, L) if t < INF else ())
    if S * L * L <= exact_limit:
        best, cuts = partition_dp(model.time, L, S)
    else:
        best, cuts = partition_fast(model.time, L, S, lower=model.p.t[L] / S)
    if not cuts:
        return best, cuts
    even = balanced_cuts(model.time, model.p.t, L, S, best)
    return best, even or cuts


def cut_and_cost(ctx: Context, cfg: Config, cuts: tuple[int, ...] | None, rec: frozenset[int] | None,
                 sel: frozenset[int] = frozenset()) -> Breakdown | None:
    """Cut (unless ``cuts`` are fixed), choose the recompute set (unless ``rec`` is fixed), cost.
    None when no cut fits (the segment model says so)."""
    costs = ctx.costs(cfg.tp, ctx.micro(cfg), cfg.param_dtype, cfg.sp)
    if cuts is None:
        _, found = partition(SegmentModel(ctx, cfg, apply_recompute(costs, rec, sel) if rec is not None else costs))
        if not found:
            return None
        cuts = found
    cfg = dataclasses.replace(cfg, cuts=cuts, selective=sel)
    cfg = dataclasses.replace(cfg, recompute=rec if rec is not None else choose_recompute(ctx, cfg))
    return evaluate(ctx, cfg)
