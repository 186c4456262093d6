"""The plan report as one self-contained HTML file: text tables plus three inline SVG pictures.

Usage::

    path = write_html(report_data, "plan.html")     # opens offline in any browser
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from fairscale.report import svg

__all__ = ["ReportData", "render_html", "write_html", "plan_figures", "page"]


@dataclass(kw_only=True)
class ReportData:
    """Everything the report shows, as plain data (built by ``fairscale.report.build_report_data``)."""

    title: str
    """Heading, e.g. ``GPT on 8 CPU ranks``."""
    text: str
    """The text report (also printed by ``pm.report()``)."""
    mesh: tuple[int, int, int]
    """(pp, dp, tp)."""
    memory: list[dict[str, float]]
    """Per stage: bytes by part (svg.MEMORY_PARTS)."""
    capacity_bytes: float
    """Device memory capacity in bytes."""
    timeline: list[svg.Box] = field(default_factory=list)
    """Simulated schedule of one step (empty when pp = 1)."""
    stage_labels: list[str] = field(default_factory=list)
    """One label per stage for the memory bars."""


_CSS = """
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 1100px; }
pre { background: #f6f8fa; padding: 12px; overflow-x: auto; font-size: 12px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
figure { margin: 0; }
"""


def plan_figures(data: ReportData, *, suffix: str = "") -> list[str]:
    """The mesh, memory and (with pp > 1) timeline figures of one plan, as HTML fragments; figure
    ids get ``suffix`` (two plans on one page, ``fairscale.report.compare``)."""
    gib = float(2**30)
    memory = [{k: v / gib for k, v in stage.items()} for stage in data.memory]
    parts = ["<h2>Device mesh</h2>", f'<figure id="mesh{suffix}">{svg.mesh_diagram(*data.mesh)}</figure>',
             "<h2>Memory per device</h2>",
             f'<figure id="memory{suffix}">{svg.memory_bars(memory, capacity=data.capacity_bytes / gib, labels=data.stage_labels or None)}</figure>']
    if data.timeline:
        rows = max(b.row for b in data.timeline) + 1
        parts += ["<h2>Pipeline timeline (one step, simulated)</h2>",
                  f'<figure id="timeline{suffix}">{svg.gantt(data.timeline, rows=rows)}</figure>']
    return parts


def page(title: str, body: list[str], *, css: str = "") -> str:
    """A self-contained HTML page (no script, no network)."""
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{_CSS}{css}</style></head>\n<body>\n" + "\n".join(body)
            + "\n</body></html>\n")


def render_html(data: ReportData) -> str:
    parts = [f"<h1>{escape(data.title)}</h1>", "<h2>Plan</h2>", f"<pre>{escape(data.text)}</pre>", *plan_figures(data)]
    return page(data.title, parts)


def write_html(data: ReportData, path: str | Path, *, overwrite: bool = True) -> Path:
    """Write the report; the file needs no network to render."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists")
    path.write_text(render_html(data))
    return path
