"""Plan diff and what-if: why one plan beats another, and what a plan would do on other hardware.

Both re-cost plans through the search's own cost model (``planner.search.cost_plan``), so their
figures are the ones the search ranked by::

    from fairscale.whatif import diff_plans, what_if
    d = diff_plans(plan_a, plan_b, graph, cluster)
    print(d.text())            # per term and per stage: where B's step time goes, against A's
    w = what_if(plan, graph, Cluster.preset("h100-sxm-80gb", nodes=64), global_batch=4096)
    print(w.text())            # does it fit, how fast, and what the search would pick there

``python -m fairscale diff a.json b.json`` and ``python -m fairscale what-if plan.json --cluster
h100-sxm-80gb --nodes 64`` print the same (``fairscale/cli_whatif.py``).

The terms are the Breakdown's: compute, recompute, tensor-, expert- and data-parallel collectives,
pipeline send/receive, the pipeline bubble and the optimizer step, each on the slowest rank per
step (seconds), then peak memory per pipeline rank and its headroom. They do not sum to the step
time exactly: the bubble is a share of the pipeline time, and overlap hides part of each
collective (each term is what stays exposed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from planner.cluster import Cluster
from planner.graph import ModelGraph
from planner.plan import Plan, PlanError
from planner.search import Breakdown, NoFeasiblePlan, SearchResult, cost_plan, search
from planner.search.tp import default_tp_rules
from planner.search.config import STEP_TERMS

__all__ = ["TERMS", "PlanDiff", "WhatIf", "diff_plans", "what_if", "fit_mesh"]

TERMS = STEP_TERMS  # (Breakdown field, label): one row each, in this order
GiB = 2**30


def _headroom(b: Breakdown) -> float:
    return b.memory_cap - max(b.memory_bytes, default=0.0)


@dataclass
class PlanDiff:
    """Two plans costed on the same model; ``a`` and ``b`` are their breakdowns."""

    a: Breakdown
    b: Breakdown
    names: tuple[str, str] = ("A", "B")
    fields: list[tuple[str, str, str]] = field(default_factory=list)
    """(plan field, A's value, B's value) for every field that differs."""

    def rows(self) -> list[tuple[str, float, float]]:
        """(term, A seconds, B seconds) per step, the bubble included."""
        return [(label, float(getattr(self.a, name)), float(getattr(self.b, name))) for name, label in TERMS]

    def text(self) -> str:
        na, nb = self.names
        a, b = self.a, self.b
        faster, slower = (na, nb) if a.step_time_s <= b.step_time_s else (nb, na)
        t_fast, t_slow = sorted((a.step_time_s, b.step_time_s))
        gain = (t_slow / t_fast - 1) * 100 if t_fast > 0 else 0.0
        lines = [f"{faster} is faster: {t_fast:.4g} s/step against {t_slow:.4g} s/step "
                 f"({slower} takes {gain:.1f}% longer)"]
        moved = sorted(self.rows(), key=lambda r: -abs(r[2] - r[1]))
        why = [f"{term} {'+' if vb >= va else '-'}{abs(vb - va):.3g} s" for term, va, vb in moved
               if abs(vb - va) > 1e-3 * max(t_fast, 1e-12)][:3]
        if why:
            lines.append(f"largest differences ({nb} against {na}): " + ", ".join(why))
        if self.fields:
            lines.append("plan fields that differ:")
            lines += [f"  {name}: {va} -> {vb}" for name, va, vb in self.fields]
        width = max(len(t) for t, _, _ in self.rows())
        lines.append(f"{'per step, slowest rank':<{width}} {na:>12} {nb:>12} {'difference':>12}")
        for term, va, vb in self.rows():
            lines.append(f"{term:<{width}} {va:>11.4g}s {vb:>11.4g}s {vb - va:>+11.3g}s")
        lines.append(f"{'step':<{width}} {a.step_time_s:>11.4g}s {b.step_time_s:>11.4g}s "
                     f"{b.step_time_s - a.step_time_s:>+11.3g}s")
        for label, va, vb in (("peak memory (worst rank)", max(a.memory_bytes), max(b.memory_bytes)),
                              ("memory headroom", _headroom(a), _headroom(b)),
                              ("bytes sent per device", a.comm_bytes, b.comm_bytes)):
            lines.append(f"{label:<{width}} {_size(va):>12} {_size(vb):>12}")
        lines += _stage_rows(a, b, self.names)
        return "\n".join(lines)


def _size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _stage_rows(a: Breakdown, b: Breakdown, names: tuple[str, str]) -> list[str]:
    out = []
    for label, br in zip(names, (a, b)):
        if len(br.stage_f_s) > 1:
            per = ", ".join(f"{f * 1e3:.3g}+{bw * 1e3:.3g}" for f, bw in zip(br.stage_f_s, br.stage_b_s))
            out.append(f"{label} per stage, forward+backward of one microbatch (ms): {per}")
    return out


def _fields(a: Plan, b: Plan) -> list[tuple[str, str, str]]:
    da, db = a.to_dict(), b.to_dict()
    out: list[tuple[str, str, str]] = []

    def walk(x: object, y: object, path: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in list(dict.fromkeys([*x, *y])):
                walk(x.get(k), y.get(k), f"{path}.{k}" if path else str(k))
        elif x != y:
            out.append((path, repr(x), repr(y)))

    for section in ("mesh", "schedule", "stages", "tensor_parallel", "data_parallel", "recompute", "batch_norm"):
        walk(da.get(section), db.get(section), section)
    return out


def diff_plans(a: Plan, b: Plan, graph: ModelGraph, cluster: Cluster, *, global_batch: int | None = None,
               names: tuple[str, str] = ("A", "B"), graph_b: ModelGraph | None = None) -> PlanDiff:
    """Cost ``a`` and ``b`` for ``graph`` on ``cluster`` (at ``global_batch``, default each plan's
    own) and say where their step times differ; raises PlanError if either is invalid there.
    ``graph_b``: the capture to cost ``b`` from where it differs from ``a``'s (plans of different
    compute dtypes are each costed from the model traced in their own: ``fairscale.api.captured``)."""
    ca = cost_plan(a, graph, cluster, global_batch=global_batch)
    cb = cost_plan(b, graph if graph_b is None else graph_b, cluster, global_batch=global_batch)
    return PlanDiff(a=ca, b=cb, names=names, fields=_fields(a, b))


def fit_mesh(plan: Plan, devices: int, global_batch: int) -> tuple[Plan | None, str]:
    """``plan`` with its data-parallel degree scaled to ``devices`` (pp, tp, stages and the rest
    kept), or None and why not."""
    pp_tp = plan.mesh.pp * plan.mesh.tp
    if devices % pp_tp:
        return None, f"{devices} devices do not divide into pp({plan.mesh.pp}) × tp({plan.mesh.tp}) = {pp_tp}"
    dp = devices // pp_tp
    m = plan.schedule.microbatches
    if global_batch % (dp * m):
        return None, (f"the global batch {global_batch} does not split into dp({dp}) × microbatches({m}) "
                      f"= {dp * m}")
    if plan.mesh.ep > 1 and dp % plan.mesh.ep:
        return None, f"dp({dp}) is not a multiple of ep({plan.mesh.ep})"
    moved = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, dp=dp),
                                schedule=dataclasses.replace(plan.schedule, global_batch=global_batch))
    return moved, "" if dp == plan.mesh.dp else f"data parallelism scaled from dp={plan.mesh.dp} to dp={dp}"


@dataclass
class WhatIf:
    """A plan re-costed on another cluster, with what the search would pick there."""

    cluster: Cluster
    global_batch: int
    cost: Breakdown | None
    """The plan's cost there (its dp scaled to the devices), or None if it cannot run there."""
    why_not: str = ""
    note: str = ""
    searched: SearchResult | None = None
    search_note: str = ""

    def text(self) -> str:
        c = self.cluster
        head = f"on {c.devices} × {c.device} ({c.nodes} node(s)) at global batch {self.global_batch}:"
        lines = [head]
        if self.cost is None:
            lines.append(f"  the plan cannot run there: {self.why_not}")
        else:
            b = self.cost
            fits = "fits" if b.fits else (f"does NOT fit: {max(b.memory_bytes) / GiB:.1f} GiB on its worst rank, "
                                          f"{b.memory_cap / GiB:.1f} GiB usable")
            lines.append(f"  the plan{' (' + self.note + ')' if self.note else ''}: {b.step_time_s:.4g} s/step, "
                         f"{b.predicted.mfu * 100:.0f}% MFU, {fits}")
        if self.searched is not None:
            best = self.searched.best
            lines.append(f"  the search would pick: {best.summary()}")
            if self.cost is not None and self.cost.fits:
                ratio = self.cost.step_time_s / best.breakdown.step_time_s
                lines.append(f"  the plan takes {ratio:.2f}× the search's step time there")
        elif self.search_note:
            lines.append(f"  the search: {self.search_note}")
        return "\n".join(lines)


def what_if(plan: Plan, graph: ModelGraph, cluster: Cluster, *, global_batch: int | None = None,
            dtype: str | None = None, tp_rules: dict[str, str] | None = None, search_too: bool = True) -> WhatIf:
    """Re-cost ``plan`` on ``cluster`` (its dp scaled to the cluster's devices; ``dtype`` replaces
    its compute dtype), and, with ``search_too``, search that cluster for comparison (with
    ``tp_rules``, default the plan's own rules)."""
    gb = global_batch or plan.schedule.global_batch or graph.batch_size
    if dtype is not None:
        plan = dataclasses.replace(plan, data_parallel=dataclasses.replace(plan.data_parallel, param_dtype=dtype))
    moved, note = fit_mesh(plan, cluster.devices, gb)
    out = WhatIf(cluster=cluster, global_batch=gb, cost=None)
    if moved is None:
        out.why_not = note
    else:
        try:
            out.cost, out.note = cost_plan(moved, graph, cluster, global_batch=gb), note
        except PlanError as exc:
            out.why_not = "; ".join(exc.problems)
    if search_too:
        rules = tp_rules if tp_rules is not None else (plan.tensor_parallel.rules or default_tp_rules(graph))
        try:
            out.searched = search(graph, cluster, global_batch=gb, tp_rules=rules, dtype=dtype, top_k=0)
        except (NoFeasiblePlan, PlanError) as exc:
            out.search_note = str(exc).splitlines()[0]
    return out
