"""The plan report as one self-contained HTML file: text tables plus three inline SVG pictures.

Usage::

    path = write_html(report_data, "plan.html")     # opens offline in any browser
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from fairscale.report import svg

__all__ = ["ReportData", "render_html", "write_html"]


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


def render_html(data: ReportData) -> str:
    gib = float(2**30)
    memory = [{k: v / gib for k, v in stage.items()} for stage in data.memory]
    parts = [f"<h1>{escape(data.title)}</h1>", "<h2>Plan</h2>", f"<pre>{escape(data.text)}</pre>",
             "<h2>Device mesh</h2>", f'<figure id="mesh">{svg.mesh_diagram(*data.mesh)}</figure>',
             "<h2>Memory per device</h2>",
             f'<figure id="memory">{svg.memory_bars(memory, capacity=data.capacity_bytes / gib, labels=data.stage_labels or None)}</figure>']
    if data.timeline:
        rows = max(b.row for b in data.timeline) + 1
        parts += ["<h2>Pipeline timeline (one step, simulated)</h2>",
                  f'<figure id="timeline">{svg.gantt(data.timeline, rows=rows)}</figure>']
    body = "\n".join(parts)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(data.title)}</title><style>{_CSS}</style></head>\n<body>\n{body}\n</body></html>\n")


def write_html(data: ReportData, path: str | Path, *, overwrite: bool = True) -> Path:
    """Write the report; the file needs no network to render."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists")
    path.write_text(render_html(data))
    return path
