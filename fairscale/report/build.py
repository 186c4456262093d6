"""Assemble a plan's report from the cost model and the schedule simulator.

    print(text_report(plan, graph))
    html_report(plan, graph=graph, cluster=cluster, title="GPT on 8 ranks", path="plan.html")

The memory bars are the cost model's per-rank breakdown (``planner.search.cost_plan``); the
timeline is one step of the plan's schedule simulated with the cost model's per-stage forward and
backward times, so it shows the bubble the prediction assumes.
"""

from __future__ import annotations

from pathlib import Path

from fairscale.report.html import ReportData, write_html
from fairscale.report.svg import MEMORY_PARTS, Box
from fairscale.report.text import render_report
from planner.cluster import Cluster
from planner.graph import ModelGraph
from planner.plan import Plan
from planner.schedule import build_schedule, simulate
from planner.search import Breakdown, cost_plan

__all__ = ["text_report", "html_report", "report_data"]


def text_report(plan: Plan, graph: ModelGraph | None = None) -> str:
    """The readable table ``pm.report()`` and ``fairscale report`` print."""
    return render_report(plan, graph)


def report_data(plan: Plan, graph: ModelGraph, cluster: Cluster, *, title: str) -> ReportData:
    """Everything the HTML report shows, computed from the cost model and the simulator."""
    cost: Breakdown = cost_plan(plan, graph, cluster, validate=False)
    memory = [{part: float(parts.get(part, 0.0)) for part in MEMORY_PARTS} for parts in cost.memory_parts]
    timeline: list[Box] = []
    s = plan.schedule
    if plan.mesh.pp > 1:
        schedule = build_schedule(s.kind, pp=plan.mesh.pp, microbatches=s.microbatches,
                                  virtual_stages=s.virtual_stages)
        sim = simulate(schedule, f_cost=cost.stage_f_s, b_cost=cost.stage_b_s)
        timeline = [Box(row=slot.rank, kind=slot.action.kind, microbatch=slot.action.mb, start=slot.start,
                        end=slot.end, label=slot.action.token(with_stage=s.virtual_stages > 1))
                    for slot in sim.slots]
    labels = [f"pp rank {r}" for r in range(len(memory))]
    return ReportData(title=title, text=render_report(plan, graph), mesh=(plan.mesh.pp, plan.mesh.dp, plan.mesh.tp),
                      memory=memory, capacity_bytes=float(cost.memory_cap), timeline=timeline, stage_labels=labels)


def html_report(plan: Plan, *, graph: ModelGraph, cluster: Cluster, title: str, path: str | Path) -> Path:
    """Write the self-contained HTML report (no network needed) and return its path."""
    return write_html(report_data(plan, graph, cluster, title=title), path)
