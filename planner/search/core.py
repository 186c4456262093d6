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

import math
import time
from typing import Callable, Union

from dataclasses import dataclass, field

from planner.cluster import Cluster, default_compute_dtype
from planner.cost import CostOptions, layer_facts
from planner.graph import ModelGraph
from planner.messages import json_path_key
from planner.plan import DTYPES, Plan, PlanError
from planner.schedule_kinds import KINDS
from planner.search.bounds import Totals, bounds, tied_elements
from planner.search.candidates import enumerate_configs
from planner.search.config import Breakdown, Config, Context
from planner.search.infeasible import no_feasible_plan
from planner.search.notes import plan_notes
from planner.search.partition import cut_and_cost
from planner.search.result import Candidate, NoCompilablePlan, SearchResult, build_plan, loss_reason
from planner.search.space import parse_constraints
from planner.search.tp import default_tp_rules
from planner.selectors import parse_selector, stage_layers
from planner.tp_styles import TPRules as DetectedRules
from planner.validate_fields import check_matches, module_names

__all__ = ["run_search", "make_context", "fixed_cuts", "fixed_recompute", "fixed_selective", "compute_dtype"]

Progress = Callable[[int, int, "float | None"], None]
_DP_ORDER = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}



def captured_dtype(graph: ModelGraph) -> str:
    """The dtype most parameters were captured in (activations are assumed to match)."""
    counts: dict[str, int] = {}
    for dt in graph.param_dtypes.values():
        counts[dt] = counts.get(dt, 0) + 1
    name = max(sorted(counts), key=lambda k: counts[k]) if counts else "float32"
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, "fp32")


TPRules = Union[dict[str, str], Callable[[int], dict[str, str]]]
Compiles = Callable[[Plan], Union[str, None]]
"""The compile check: a plan -> None if the passes compile it, else the reason (see ``search``)."""


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
        if tp not in cache:  # a TPRules keeps the detector's reasons for what it left out
            got = fn(tp) if tp > 1 else {}
            got = got if isinstance(got, DetectedRules) else dict(got)
            cache[tp] = whole_heads(graph, one_layout_per_tied(graph, got), tp)
        return cache[tp]
    return at


def one_layout_per_tied(graph: ModelGraph, rules: dict[str, str]) -> dict[str, str]:
    """Proposed ``rules`` without those that would give a tied tensor two layouts (T5's shared
    embedding split as encoder and decoder ``vocab_embedding`` while the LM head that reads it
    is left whole, or the reverse): the modules reading such a tensor are all kept whole, which
    validation accepts and the pipeline's tied-gradient sum needs. The reason is added to the
    detector's ``reason`` so a refusal of tensor parallelism can say it."""
    from planner.selectors import parse_selector
    from planner.validate_tp import tied_conflicts

    out = dict(rules)
    dropped: list[str] = []
    while True:
        conflicts = tied_conflicts(graph, [(text, parse_selector(text), style) for text, style in out.items()])
        texts = {text for _, layouts in conflicts for text, _ in layouts.values() if text is not None}
        if not texts:
            break
        for text in texts:
            dropped.append(text)
            del out[text]
    return _without(rules, set(dropped), f"rules {sorted(dropped)} left out: they gave a tied weight two layouts "
                    "(the modules that read it must split it alike or all keep it whole)")


def whole_heads(graph: ModelGraph, rules: dict[str, str], tp: int) -> dict[str, str]:
    """Proposed ``rules`` without those that split the heads of an attention whose heads or kv heads
    ``tp`` does not divide (multi-query attention: one kv head): that attention is kept whole and
    the rest (the MLP) is still split, which trains exactly, where the whole degree had been
    refused. The reason is added to the detector's ``reason``, as :func:`one_layout_per_tied` does."""
    from planner.selectors import parse_selector
    from planner.validate_tp import head_splitting_rules

    dropped = head_splitting_rules(graph, [(text, parse_selector(text), style) for text, style in rules.items()], tp)
    return _without(rules, dropped, f"rules {sorted(dropped)} left out at tp {tp}: they split attention heads that "
                    f"tp {tp} does not divide (each tp rank must hold whole heads), so that attention is kept whole")


def _without(rules: dict[str, str], dropped: set[str], note: str) -> dict[str, str]:
    """``rules`` less ``dropped``, with ``note`` added to the detector's ``reason`` (so a refusal of
    tensor parallelism can say it); ``rules`` itself when nothing is dropped."""
    if not dropped:
        return rules
    reason = getattr(rules, "reason", "")
    return DetectedRules({k: v for k, v in rules.items() if k not in dropped},
                         reason=f"{reason}; {note}" if reason else note)


def make_context(graph: ModelGraph, cluster: Cluster, *, global_batch: int, rules: TPRules | None,
                 options: CostOptions | None) -> Context:
    """The search context; ``rules`` is a dict (the same rules at every tp) or a function of tp."""
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if graph.layers and not any(layer.flops_fwd or layer.flops_bwd for layer in graph.layers):
        raise ValueError("the graph carries no FLOPs, so every plan would cost nothing: capture it with "
                         "annotate=True (the default) before planning")
    at = rules_function(graph, rules)
    if options is None:  # the plan runs on fairscale's runtime: cost what it overlaps and holds
        options = CostOptions.for_runtime(cluster)
    return Context(layer_facts(graph, {}), cluster, global_batch=global_batch, options=options,
                   captured_dtype=captured_dtype(graph), facts_for_tp=lambda tp: layer_facts(graph, at(tp)),
                   graph=graph)


def fixed_cuts(ctx: Context, stages: list[str]) -> tuple[int, ...]:
    """Stage selectors -> boundaries; each stage must be a contiguous run following the previous one."""
    names = [f.name for f in ctx.facts]
    cuts = [0]
    problems = []
    index = {n: i for i, n in enumerate(names)}
    held = stage_layers([parse_selector(text) for text in stages], names)
    for k, text in enumerate(stages):
        idx = [index[n] for n in held[k]]
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


def _check_rule_modules(graph: ModelGraph, rules: dict[str, str] | None) -> None:
    """A tensor-parallel rule of the constraints that selects no module is refused here, as the plan's
    validation refuses it (``planner.validate_tp``): the search had kept it, and ``parallelize(plan=...)``
    of the plan ``fairscale.plan`` returned refused it on every rank."""
    problems: list[str] = []
    for key in rules or {}:
        check_matches(json_path_key("tensor_parallel.rules", key), parse_selector(key), module_names(graph), "module",
                      problems)
    if problems:
        raise PlanError(problems, source="constraints")


def run_search(graph: ModelGraph, cluster: Cluster, *, global_batch: int, constraints: object = None,
               top_k: int = 3, progress: Progress | None = None, tp_rules: TPRules | None = None,
               options: CostOptions | None = None, dtype: str | None = None,
               use_all_devices: bool = False, compiles: Compiles | None = None,
               check_runners_up: bool = True) -> SearchResult:
    start = time.perf_counter()
    fixed = parse_constraints(constraints)  # type: ignore[arg-type]
    if fixed.global_batch is not None and fixed.global_batch != global_batch:
        raise PlanError([f"schedule.global_batch: the constraints were made for a global batch of "
                         f"{fixed.global_batch}, but the search is for {global_batch}; drop it or search for "
                         f"{fixed.global_batch}"], source="constraints")
    _check_rule_modules(graph, fixed.tp_rules)
    fixed.param_dtype = compute_dtype(fixed.param_dtype, dtype, cluster)
    rules = rules_function(graph, fixed.tp_rules if fixed.tp_rules is not None else tp_rules)
    ctx = make_context(graph, cluster, global_batch=global_batch, rules=rules, options=options)
    cuts = fixed_cuts(ctx, fixed.stages) if fixed.stages else None
    rec = fixed_recompute(ctx, fixed.recompute) if fixed.recompute is not None else None
    sel = fixed_selective(ctx, fixed.recompute) if fixed.recompute is not None else frozenset()
    idle = not use_all_devices
    cands, notes = enumerate_configs(graph, ctx, fixed, rules, cuts, idle=idle)
    found = _explore(ctx, cands, cuts, rec, sel, top_k, progress)
    if not found.best:  # nothing with m >= pp: pipelines shorter in microbatches than in stages
        more, more_notes = enumerate_configs(graph, ctx, fixed, rules, cuts, idle=idle, short_pipelines=True)
        known = set(cands)
        extra = [c for c in more if c not in known]
        if extra:
            cands, notes = cands + extra, notes + more_notes
            found = _explore(ctx, cands, cuts, rec, sel, top_k, progress)
    if not cands:
        raise PlanError(["no configuration satisfies the constraints: " + "; ".join(notes or ["(none enumerated)"])],
                        source="search")
    if not found.best:
        raise no_feasible_plan(ctx, graph, fixed, found.mem_fail, found.closest, cuts, rec, sel)
    ranked = [b for _, b in _ranked(found.best)][: top_k + 1]
    win = ranked[0]
    full = _best_on_all_devices(ctx, found, cuts, rec, sel) if win.devices < cluster.devices else None
    if full is None and win.devices < cluster.devices:  # perhaps only pipelines shorter than their stages fill them
        more, _ = enumerate_configs(graph, ctx, fixed, rules, cuts, short_pipelines=True)
        n = cluster.devices
        full = _best_on_all_devices(ctx, _explore(ctx, [c for c in more if c.pp * c.dp * c.tp == n], cuts, rec, sel,
                                                  0, None), cuts, rec, sel)

    def plan_of(b: Breakdown) -> Plan:
        assert b.config is not None
        b.notes.extend(plan_notes(ctx, b, idle_reason=_idle_reason(ctx, b, full)))
        plan = build_plan(graph, ctx, b.config, b, tp_rules=rules(b.config.tp), units=b.config.units or fixed.units)
        plan.batch_norm = fixed.batch_norm or plan.batch_norm
        return plan

    if compiles is None:
        out = [Candidate(plan=plan_of(b), breakdown=b, reason="" if b is win else loss_reason(b, win))
               for b in ranked]
        return SearchResult(best=out[0], runners_up=out[1:], considered=len(cands), evaluated=found.evaluated,
                            elapsed_s=time.perf_counter() - start)
    accepted, refused, extra_costed = _check_compiles(ctx, cands, found, top_k if check_runners_up else 0, cuts,
                                                      rec, sel, plan_of, compiles)
    if not accepted:
        raise NoCompilablePlan(refused)
    if not check_runners_up:  # the next-best meshes, costed but not compiled
        gone = {_mesh(c.breakdown) for c in accepted + refused}
        for mesh, b in _ranked(found.best):
            if len(accepted) == top_k + 1:
                break
            if mesh not in gone:
                accepted.append(Candidate(plan=plan_of(b), breakdown=b, checked=False))
    win = accepted[0].breakdown
    for c in accepted[1:]:
        c.reason = loss_reason(c.breakdown, win)
    return SearchResult(best=accepted[0], runners_up=accepted[1:], refused=refused, considered=len(cands),
                        evaluated=found.evaluated + extra_costed, elapsed_s=time.perf_counter() - start)


def compute_dtype(fixed: str | None, asked: str | None, cluster: Cluster) -> str:
    """The compute dtype: the constraints' ``data_parallel.param_dtype`` or ``dtype=`` (which must
    agree), else :func:`planner.cluster.default_compute_dtype` (mixed precision on GPUs)."""
    if asked is not None and asked != "auto":
        asked = DTYPE_NAMES.get(asked, asked)
        if asked not in DTYPES:
            raise PlanError([f"dtype: {asked!r} is not one of {', '.join(DTYPES)} (or auto)"], source="search")
        if fixed is not None and fixed != asked:
            raise PlanError([f'dtype: {asked!r}, but the constraints fix data_parallel.param_dtype "{fixed}"; '
                             "give one of them, or make them agree"], source="constraints")
        return asked
    return fixed or default_compute_dtype(cluster)


@dataclass
class _Found:
    """What one pass of branch and bound found."""

    best: dict[tuple[int, int, int], tuple[float, tuple[object, ...], Breakdown]] = field(default_factory=dict)
    """Per mesh (pp, dp, tp): (step time, tie-break order, breakdown) of its best plan that fits."""
    bounded: list[tuple[float, tuple[object, ...], Config, float]] = field(default_factory=list)
    """(time bound, order, configuration, memory bound) of everything whose memory bound fits, best bound first."""
    mem_fail: list[tuple[float, Config]] = field(default_factory=list)
    """(bytes over, configuration) of those whose memory bound does not fit."""
    closest: Breakdown | None = None
    """The costed configuration that missed the memory cap by the least."""
    evaluated: int = 0


def _explore(ctx: Context, cands: list[Config], cuts: tuple[int, ...] | None, rec: frozenset[int] | None,
             sel: frozenset[int], top_k: int, progress: Progress | None,
             skip: frozenset[tuple[int, int, int]] = frozenset()) -> _Found:
    """Bound every candidate, then cost them best bound first until no bound can beat the
    ``top_k + 1`` best meshes (module docstring, steps 2-4); meshes (pp, dp, tp) in ``skip``
    (refused by the compile check) are passed over."""
    found = _Found()
    totals: dict[tuple[int, int, str, bool], Totals] = {}
    for cfg in cands:
        key = (cfg.tp, ctx.micro(cfg), cfg.param_dtype, cfg.sp)
        if key not in totals:
            totals[key] = Totals(ctx.costs(*key), rec, sel)
            totals[key].tied = tied_elements(ctx, cfg.tp)
        lb, mem_lb = bounds(ctx, cfg, totals[key])
        if mem_lb > ctx.cap or math.isinf(lb):
            found.mem_fail.append((mem_lb - ctx.cap, cfg))
            continue
        found.bounded.append((lb, _order(cfg), cfg, mem_lb))
    found.bounded.sort(key=lambda x: (x[0], x[1]))
    keep = top_k + 1
    best = found.best
    for n, (lb, order, cfg, _) in enumerate(found.bounded):
        times = sorted(v[0] for v in best.values())
        threshold = times[keep - 1] if len(times) >= keep else float("inf")
        if lb >= threshold:
            break
        mesh = (cfg.pp, cfg.dp, cfg.tp)
        if mesh in skip or (mesh in best and lb >= best[mesh][0]):
            continue
        if progress is not None and n % 64 == 0:
            progress(n, len(found.bounded), times[0] if times else None)
        found.evaluated += 1
        b = cut_and_cost(ctx, cfg, cuts, rec, sel)
        if b is None:
            continue
        if not b.fits:
            if found.closest is None or b.shortfall < found.closest.shortfall:
                found.closest = b
            continue
        if mesh not in best or (b.step_time_s, order) < best[mesh][:2]:
            best[mesh] = (b.step_time_s, order, b)
    if progress is not None:
        progress(len(found.bounded), len(found.bounded), min((v[0] for v in best.values()), default=None))
    return found


def _order(cfg: Config) -> tuple[object, ...]:
    """Tie-break among equally fast plans: the simpler schedule, the less sharded kind, fewer parts."""
    return (KINDS[cfg.kind].order, _DP_ORDER[cfg.dp_kind], not cfg.reshard, cfg.sp, cfg.units is not None,
            cfg.microbatches, cfg.v, cfg.pp, cfg.tp)


def _best_on_all_devices(ctx: Context, found: _Found, cuts: tuple[int, ...] | None, rec: frozenset[int] | None,
                         sel: frozenset[int]) -> Breakdown | None:
    """The fastest plan ``found`` has that uses every device (costed now if branch and bound skipped
    it: the best bound that fits), or None."""
    n = ctx.cluster.devices
    full = [x for x in found.best.values() if x[2].devices == n]
    if full:
        return min(full, key=lambda x: (x[0], x[1]))[2]
    for _, _, cfg, _ in found.bounded:  # best bound first
        if cfg.pp * cfg.dp * cfg.tp == n:
            b = cut_and_cost(ctx, cfg, cuts, rec, sel)
            if b is not None and b.fits:
                return b
    return None


def _idle_reason(ctx: Context, b: Breakdown, full: Breakdown | None) -> str:
    """Why a plan that leaves devices idle does not use them all: the best plan on every device and
    what makes it slower, or why there is none."""
    n = ctx.cluster.devices
    if b.devices >= n:
        return ""
    if full is None or full.config is None:
        return (f"no plan on all {n} devices fits: a data-parallel degree must divide the global batch of "
                f"{ctx.global_batch}, and the meshes that do fill {n} devices need more memory than there is")
    c = full.config
    return (f"the best plan on all {n} devices (pp={c.pp} dp={c.dp} tp={c.tp} {KINDS[c.kind].label(c.v)} "
            f"m={c.microbatches}) is {loss_reason(full, b)}")


def _ranked(best: dict[tuple[int, int, int], tuple[float, tuple[object, ...], Breakdown]]) \
        -> list[tuple[tuple[int, int, int], Breakdown]]:
    """``_Found.best``'s meshes and their best plans, fastest first (ties in the search's order)."""
    return [(mesh, b) for mesh, (_, _, b) in sorted(best.items(), key=lambda kv: (kv[1][0], kv[1][1]))]


def _mesh(b: Breakdown) -> tuple[int, int, int]:
    """The (pp, dp, tp) mesh of a costed plan: its key in ``_Found.best``."""
    assert b.config is not None
    return b.config.pp, b.config.dp, b.config.tp


def _check_compiles(ctx: Context, cands: list[Config], found: _Found, top_k: int, cuts: tuple[int, ...] | None,
                    rec: frozenset[int] | None, sel: frozenset[int], plan_of: Callable[[Breakdown], Plan],
                    compiles: Compiles) -> tuple[list[Candidate], list[Candidate], int]:
    """The winner and up to ``top_k`` runners-up that ``compiles`` accepts, best first, the
    candidates it refused (with its reason) in the order they were checked, and how many more
    configurations were costed to find them.

    Candidates are checked fastest first. A refusal rules out its whole mesh (pp, dp, tp): the
    other configurations of a mesh share its stage cuts and tensor-parallel rules, where the
    refusals come from, so the search moves to the next mesh (conservative: a mesh refused for a
    reason particular to one schedule or data-parallel kind is given up whole). When every kept
    mesh is refused before a winner is found, branch and bound runs again without the refused
    meshes, until a mesh compiles or none is left."""
    accepted: list[Candidate] = []
    refused: list[Candidate] = []
    skip: set[tuple[int, int, int]] = set()
    evaluated = 0
    best = found.best
    while True:
        for mesh, b in _ranked(best):
            if mesh in skip or any(c.breakdown is b for c in accepted):
                continue
            plan = plan_of(b)
            why = compiles(plan)
            if why:
                refused.append(Candidate(plan=plan, breakdown=b, reason=f"does not compile: {why}", refused=why))
                skip.add(mesh)
            else:
                accepted.append(Candidate(plan=plan, breakdown=b))
                if len(accepted) == top_k + 1:
                    return accepted, refused, evaluated
        if accepted:
            return accepted, refused, evaluated
        again = _explore(ctx, cands, cuts, rec, sel, top_k, None, skip=frozenset(skip))
        evaluated += again.evaluated
        if not again.best:
            return accepted, refused, evaluated
        best = again.best
