"""Find a plan: pp × dp × tp mesh, stage cuts, TP rules, data parallelism, recompute, schedule.

Usage::

    from planner.cluster import Cluster
    from planner.search import search, cost_plan
    result = search(graph, Cluster.preset("a100-80gb", nodes=4), global_batch=512,
                    constraints={"mesh": {"tp": 8}})
    print(result.table())          # best plan + runners-up and why each lost
    plan = result.plan             # a planner.plan.Plan with predicted filled in
    cost_plan(plan, graph, cluster, global_batch=512).predicted   # re-cost a (hand-edited) plan

Seams with the rest of fairscale:

* ``tp_rules`` (selector -> style, or tp -> that) is the tensor-parallel candidate set, given as
  data because the planner must not import ``passes`` (where the pattern detector,
  ``passes.tp.patterns.propose_tp_rules``, lives). Without it the planner uses
  :func:`planner.search.tp.default_tp_rules`. A constraint ``{"tensor_parallel": {"rules": ...}}``
  overrides both. A degree whose rules are empty is not considered.
* ``options`` (:class:`planner.cost.CostOptions`) says what the runtime overlaps.
* ``compiles`` (plan -> None, or the reason the passes cannot compile it) is the plan-time
  compilation check, given as a function for the same reason (the face passes
  ``fairscale.compile_check.checker_for(model, batch, loss_fn=...)``). With it the search never
  returns a plan the passes refuse: it checks the winner and the runners-up fastest first, a
  refused plan moves the search on to the next mesh, and each refusal is kept in
  ``SearchResult.refused`` and its table. If every plan that fits is refused it raises
  :class:`NoCompilablePlan` with all the reasons.
"""

from __future__ import annotations

from typing import Any, Callable

from planner.cluster import Cluster
from planner.cost import CostOptions
from planner.graph import ModelGraph
from planner.plan import Plan, PlanError
from planner.search.core import fixed_cuts, fixed_recompute, fixed_selective, make_context, run_search
from planner.search.config import Breakdown, Config
from planner.search.core import Compiles
from planner.search.evaluate import evaluate
from planner.search.notes import precision_note
from planner.search.result import Candidate, NoCompilablePlan, NoFeasiblePlan, SearchResult
from planner.search.tp import default_tp_rules
from planner.validate import validate_plan

__all__ = ["search", "cost_plan", "SearchResult", "Candidate", "Breakdown", "NoFeasiblePlan", "NoCompilablePlan", "Compiles",
           "default_tp_rules"]


def search(graph: ModelGraph, cluster: Cluster, *, global_batch: int, constraints: dict[str, Any] | Plan | None = None,
           top_k: int = 3, progress: Callable[[int, int, float | None], None] | None = None,
           tp_rules: dict[str, str] | Callable[[int], dict[str, str]] | None = None,
           options: CostOptions | None = None, dtype: str | None = None,
           use_all_devices: bool = False, compiles: Compiles | None = None,
           check_runners_up: bool = True) -> SearchResult:
    """Best plan for ``graph`` on ``cluster`` at ``global_batch`` samples per step, plus ``top_k``
    runners-up (one per mesh shape).

    Args:
        constraints: a partial plan (dict in the plan's JSON shape) whose fields are kept; the
            search fills in the rest. See ``planner.search.space``.
        progress: called as ``progress(done, total, best_step_time_or_None)`` while searching.
        tp_rules: tensor-parallel candidates (selector -> style), or a function of the tp degree
            returning them (e.g. ``lambda tp: propose_tp_rules(graph.gm, tp=tp).rules``, which
            only keeps rules the TP pass accepts at that degree); default: :func:`default_tp_rules`.
        options: runtime overlap model and memory reserve.
        dtype: compute dtype (``bf16``, ``fp16``, ``fp32`` or ``auto``); default: the constraints'
            ``data_parallel.param_dtype``, else mixed precision on GPU clusters (bf16, or fp16 where
            bf16 is unsupported) and fp32 on CPU ranks (``planner.cluster.default_compute_dtype``).
        use_all_devices: every plan uses every device (what a launched world needs); otherwise a
            plan may leave devices idle when the batch does not split over them, and says why.
        compiles: the compile check (module docstring); without it plans are costed, not compiled.
        check_runners_up: with ``compiles``, check the runners-up too (else only the winner, and
            the runners-up come back costed, ``Candidate.checked`` False).

    Raises:
        NoFeasiblePlan: nothing fits; the message gives the smallest shortfall and what would help.
        NoCompilablePlan: plans fit, but ``compiles`` refused every one of them.
        PlanError: the constraints are malformed or contradict each other.
    """
    return run_search(graph, cluster, global_batch=global_batch, constraints=constraints, top_k=top_k,
                      progress=progress, tp_rules=tp_rules, options=options, dtype=dtype,
                      use_all_devices=use_all_devices, compiles=compiles, check_runners_up=check_runners_up)


def cost_plan(plan: Plan, graph: ModelGraph, cluster: Cluster, *, global_batch: int | None = None,
              options: CostOptions | None = None, validate: bool = True) -> Breakdown:
    """Predicted cost of a complete (for example hand-edited) plan, through the same model the
    search uses. ``breakdown.predicted`` is the :class:`planner.plan.Predicted` to store in it;
    ``breakdown.fits`` says whether it fits in memory. ``global_batch`` defaults to the one the
    plan records (``schedule.global_batch``)."""
    if validate:
        validate_plan(plan, graph, cluster, runnable=False)
    if global_batch is None:
        global_batch = plan.schedule.global_batch
        if not global_batch:
            raise PlanError(["schedule.global_batch: the plan does not record its global batch; pass "
                             "global_batch= to cost it"], source="plan")
    ctx = make_context(graph, cluster, global_batch=global_batch, rules=plan.tensor_parallel.rules, options=options)
    mesh, sched, dp = plan.mesh, plan.schedule, plan.data_parallel
    if mesh.size > cluster.devices:
        raise PlanError([f"mesh: pp({mesh.pp}) × dp({mesh.dp}) × tp({mesh.tp}) = {mesh.size}, but the cluster has "
                         f"{cluster.devices} devices"], source="plan")
    if dp.offload and dp.kind != "fsdp":
        raise PlanError([f'data_parallel.offload: the cost model offloads FSDP shards only, but data_parallel.kind '
                         f'is "{dp.kind}"; use "fsdp" or set offload to false'], source="plan")
    stages = mesh.pp * sched.virtual_stages
    cuts = fixed_cuts(ctx, [s.layers for s in plan.stages]) if plan.stages else (0, len(ctx.facts))
    if len(cuts) - 1 != stages:
        raise PlanError([f"stages: {len(cuts) - 1} given, but pp({mesh.pp}) × virtual_stages({sched.virtual_stages})"
                         f" = {stages} are needed"], source="plan")
    rec = fixed_recompute(ctx, plan.recompute) if plan.recompute else frozenset()
    sel = fixed_selective(ctx, plan.recompute) if plan.recompute else frozenset()
    units = dp.units if dp.kind == "fsdp" and dp.units else None
    if units is not None:
        ctx.units(units)  # a selector that selects no module holding parameters is an error
    cfg = Config(pp=mesh.pp, dp=mesh.dp, tp=mesh.tp, microbatches=sched.microbatches, kind=sched.kind,
                 v=sched.virtual_stages, dp_kind=dp.kind, reshard=dp.reshard_after_forward, prefetch=dp.prefetch,
                 sp=plan.tensor_parallel.sequence_parallel, param_dtype=dp.param_dtype, reduce_dtype=dp.reduce_dtype,
                 bucket_mb=dp.bucket_mb, cuts=cuts, recompute=rec, selective=sel, units=units,
                 offload=dp.offload, ep=mesh.ep)
    b = evaluate(ctx, cfg)
    b.notes.append(precision_note(cfg.param_dtype, cfg.reduce_dtype))
    if mesh.size < cluster.devices:
        b.notes.append(f"using {mesh.size} of {cluster.devices} devices (this plan's mesh)")
    return b

