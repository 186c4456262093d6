"""Two plans side by side in one offline HTML page: ``fairscale diff a.json b.json --html out.html``.

Usage::

    from fairscale.report.compare import diff_html_report
    diff_html_report(plan_a, plan_b, graph=graph, cluster=cluster, names=("a.json", "b.json"), path="diff.html")

The page has the diff's verdict (``fairscale.whatif.PlanDiff.text``), a table and paired bars of
each term per step (compute, recompute, each collective, the bubble, the optimizer), each plan's
forward and backward per pipeline stage, the memory per pipeline rank, the plan fields that
differ, and then each plan's own report figures (mesh, memory bars, simulated timeline) in two
columns, drawn by the single-plan report (``fairscale.report.html.plan_figures``).
"""

from __future__ import annotations

import dataclasses
from html import escape
from pathlib import Path

from fairscale.report import svg
from fairscale.report.build import report_data
from fairscale.report.html import ReportData, page, plan_figures
from fairscale.whatif import PlanDiff, diff_plans
from planner.cluster import Cluster
from planner.graph import ModelGraph
from planner.plan import Plan

__all__ = ["render_diff_html", "diff_html_report"]

_CSS = """
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
td:first-child, th:first-child { text-align: left; }
.cols { display: flex; gap: 16px; } .cols > div { flex: 1; min-width: 0; overflow-x: auto; }
"""


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def _table(head: list[str], rows: list[list[str]], *, cls: str) -> str:
    out = [f'<table class="{cls}"><tr>' + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows]
    return "\n".join(out) + "</table>"


def _stage_rows(diff: PlanDiff) -> list[list[str]]:
    a, b = diff.a, diff.b
    rows = []
    for s in range(max(len(a.stage_f_s), len(b.stage_f_s))):
        cells = [f"stage {s}"]
        for br in (a, b):
            cells += [_ms(br.stage_f_s[s]), _ms(br.stage_b_s[s])] if s < len(br.stage_f_s) else ["", ""]
        rows.append(cells)
    return rows


def render_diff_html(diff: PlanDiff, a: ReportData, b: ReportData) -> str:
    """The side-by-side page of two costed plans (``a`` and ``b``: their single-plan report data)."""
    na, nb = diff.names
    terms = [*diff.rows(), ("step", diff.a.step_time_s, diff.b.step_time_s)]
    term_rows = [[t, _ms(va), _ms(vb), f"{(vb - va) * 1e3:+.3g}"] for t, va, vb in terms]
    body = [f"<h1>{escape(na)} against {escape(nb)}</h1>", f"<pre>{escape(diff.text().splitlines()[0])}</pre>",
            "<h2>Per term, one step on the slowest rank</h2>",
            _table(["ms per step", na, nb, f"{nb} − {na}"], term_rows, cls="terms"),
            f'<figure id="terms">{svg.paired_bars([(t, va * 1e3, vb * 1e3) for t, va, vb in terms], names=(na, nb))}'
            "</figure>",
            "<h2>Per pipeline stage, one microbatch</h2>",
            _table(["stage", f"{na} forward ms", f"{na} backward ms", f"{nb} forward ms", f"{nb} backward ms"],
                   _stage_rows(diff), cls="stages")]
    mem = [[f"pp rank {r}", *(f"{m[r] / 2**30:.3f}" if r < len(m) else "" for m in (diff.a.memory_bytes,
                                                                                      diff.b.memory_bytes))]
           for r in range(max(len(diff.a.memory_bytes), len(diff.b.memory_bytes)))]
    body += ["<h2>Peak memory per pipeline rank (GiB)</h2>", _table(["rank", na, nb], mem, cls="memory")]
    if diff.fields:
        body += ["<h2>Plan fields that differ</h2>",
                 _table(["field", na, nb], [list(f) for f in diff.fields], cls="fields")]
    columns = [f"<div><h2>{escape(name)}</h2><pre>{escape(data.text)}</pre>" + "\n".join(plan_figures(data, suffix=sfx))
               + "</div>" for name, data, sfx in ((na, a, "-a"), (nb, b, "-b"))]
    body += ['<div class="cols">', *columns, "</div>"]
    return page(f"{na} against {nb}", body, css=_CSS)


def diff_html_report(plan_a: Plan, plan_b: Plan, *, graph: ModelGraph, cluster: Cluster, path: str | Path,
                     names: tuple[str, str] = ("A", "B"), global_batch: int | None = None,
                     graph_b: ModelGraph | None = None) -> Path:
    """Cost both plans (as ``fairscale.whatif.diff_plans``, ``graph_b`` for ``plan_b`` where given)
    and write the side-by-side page to ``path``."""
    diff = diff_plans(plan_a, plan_b, graph, cluster, global_batch=global_batch, names=names, graph_b=graph_b)
    datas = []
    for plan, name, g in ((plan_a, names[0], graph), (plan_b, names[1], graph if graph_b is None else graph_b)):
        if global_batch:
            plan = dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, global_batch=global_batch))
        datas.append(report_data(plan, g, cluster, title=name))
    path = Path(path)
    path.write_text(render_diff_html(diff, *datas))
    return path
