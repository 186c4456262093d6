"""Three SVG pictures for the plan report, drawn from plain data (no plotting library, no network).

* :func:`gantt`: a pipeline timeline, one row per pipeline rank, one box per forward/backward of a
  microbatch, from the schedule simulator's timeline.
* :func:`memory_bars`: stacked per-device memory (parameters, gradients, optimizer, activations,
  buffers) against the device's capacity.
* :func:`mesh_diagram`: the pp × dp × tp grid of ranks.
* :func:`paired_bars`: two plans' values side by side, one pair of bars per row (``fairscale diff --html``).
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

__all__ = ["Box", "gantt", "memory_bars", "mesh_diagram", "paired_bars", "MEMORY_PARTS"]

MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations", "buffers")
_COLORS = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer": "#e15759",
           "activations": "#76b7b2", "buffers": "#b07aa1", "F": "#59a14f", "B": "#e15759",
           "W": "#f1ce63", "idle": "#eeeeee"}


@dataclass(frozen=True)
class Box:
    """One action on the timeline: ``kind`` F (forward), B (backward) or W (weight gradient)."""

    row: int
    kind: str
    microbatch: int
    start: float
    end: float
    label: str = ""


def _svg(width: float, height: float, body: list[str], title: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{escape(title)}" '
            f'font-family="sans-serif" font-size="11">\n<title>{escape(title)}</title>\n'
            + "\n".join(body) + "\n</svg>")


def gantt(boxes: list[Box], *, rows: int, title: str = "pipeline timeline", width: float = 760) -> str:
    """Timeline of ``boxes`` on ``rows`` pipeline ranks; time runs left to right."""
    if not boxes:
        raise ValueError("gantt needs at least one action")
    left, row_h, top = 70.0, 26.0, 24.0
    t_end = max(b.end for b in boxes)
    scale = (width - left - 10) / t_end if t_end > 0 else 1.0
    body = [f'<text x="{left}" y="14">{escape(title)} (time →)</text>']
    for r in range(rows):
        y = top + r * row_h
        body.append(f'<text x="4" y="{y + 16:.1f}">stage {r}</text>')
        body.append(f'<rect x="{left}" y="{y:.1f}" width="{t_end * scale:.1f}" height="{row_h - 4}" '
                    f'fill="{_COLORS["idle"]}"/>')
    for b in boxes:
        x, w = left + b.start * scale, max((b.end - b.start) * scale, 1.0)
        y = top + b.row * row_h
        color = _COLORS.get(b.kind, "#999999")
        text = b.label or f"{b.kind}{b.microbatch}"
        body.append(f'<rect class="action" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{row_h - 4}" '
                    f'fill="{color}" stroke="#ffffff"><title>{escape(text)}: {b.start:.3g}–{b.end:.3g}</title></rect>')
        if w > 18:
            body.append(f'<text x="{x + 3:.1f}" y="{y + 15:.1f}" fill="#ffffff">{escape(text)}</text>')
    return _svg(width, top + rows * row_h + 8, body, title)


def memory_bars(devices: list[dict[str, float]], *, capacity: float, unit: str = "GiB",
                labels: list[str] | None = None, title: str = "memory per device", width: float = 760) -> str:
    """Stacked bars, one per device (or stage): ``devices[i][part]`` in ``unit``; a line at ``capacity``."""
    if not devices:
        raise ValueError("memory_bars needs at least one device")
    labels = labels or [f"stage {i}" for i in range(len(devices))]
    left, bar_h, gap, top = 70.0, 20.0, 8.0, 40.0
    peak = max(capacity, max(sum(d.get(p, 0.0) for p in MEMORY_PARTS) for d in devices))
    scale = (width - left - 80) / peak if peak > 0 else 1.0
    body = [f'<text x="{left}" y="14">{escape(title)} ({unit}); dashed line = capacity {capacity:.3g} {unit}</text>']
    for i, part in enumerate(MEMORY_PARTS):
        x = left + i * 120
        body.append(f'<rect x="{x}" y="20" width="10" height="10" fill="{_COLORS[part]}"/>'
                    f'<text x="{x + 14}" y="29">{part}</text>')
    for i, dev in enumerate(devices):
        y = top + i * (bar_h + gap)
        body.append(f'<text x="4" y="{y + 14:.1f}">{escape(labels[i])}</text>')
        x = left
        for part in MEMORY_PARTS:
            v = dev.get(part, 0.0)
            if v <= 0:
                continue
            w = v * scale
            body.append(f'<rect class="mem" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{bar_h}" '
                        f'fill="{_COLORS[part]}"><title>{part}: {v:.4g} {unit}</title></rect>')
            x += w
        total = sum(dev.get(p, 0.0) for p in MEMORY_PARTS)
        body.append(f'<text x="{x + 4:.1f}" y="{y + 14:.1f}">{total:.3g}</text>')
    cap_x = left + capacity * scale
    height = top + len(devices) * (bar_h + gap) + 4
    body.append(f'<line x1="{cap_x:.1f}" y1="{top - 4}" x2="{cap_x:.1f}" y2="{height - 4:.1f}" '
                f'stroke="#000000" stroke-dasharray="4 3"/>')
    return _svg(width, height, body, title)


def mesh_diagram(pp: int, dp: int, tp: int, *, title: str = "device mesh", width: float = 760) -> str:
    """pp columns of dp × tp rank grids; rank = (pp_i × dp + dp_i) × tp + tp_i."""
    cell, pad, top = 34.0, 24.0, 36.0
    block_w = tp * cell + pad
    width = max(width, pp * block_w + 20)
    body = [f'<text x="10" y="14">{escape(title)}: pp={pp} × dp={dp} × tp={tp} '
            f'(columns: pipeline stages; rows: data-parallel replicas; cells in a row: tensor-parallel group)</text>']
    for s in range(pp):
        x0 = 10 + s * block_w
        body.append(f'<text x="{x0}" y="{top - 6}">stage {s}</text>')
        for d in range(dp):
            for t in range(tp):
                rank = (s * dp + d) * tp + t
                x, y = x0 + t * cell, top + d * cell
                body.append(f'<rect class="rank" x="{x:.1f}" y="{y:.1f}" width="{cell - 4}" height="{cell - 4}" '
                            f'fill="#4e79a7" rx="4"><title>rank {rank}: pp {s}, dp {d}, tp {t}</title></rect>'
                            f'<text x="{x + 6:.1f}" y="{y + 19:.1f}" fill="#ffffff">{rank}</text>')
    return _svg(width, top + dp * cell + 10, body, title)


PAIR_COLORS = ("#4e79a7", "#f28e2b")


def paired_bars(rows: list[tuple[str, float, float]], *, names: tuple[str, str], unit: str = "ms",
                title: str = "per term", width: float = 760) -> str:
    """One pair of horizontal bars per ``(label, a, b)`` row, ``a`` over ``b``, on one scale."""
    if not rows:
        raise ValueError("paired_bars needs at least one row")
    left, bar_h, gap, top = 220.0, 10.0, 8.0, 40.0
    peak = max(max(a, b) for _, a, b in rows)
    scale = (width - left - 80) / peak if peak > 0 else 1.0
    body = [f'<text x="4" y="14">{escape(title)} ({unit})</text>']
    for i, name in enumerate(names):
        body.append(f'<rect x="{left + i * 200}" y="20" width="10" height="10" fill="{PAIR_COLORS[i]}"/>'
                    f'<text x="{left + i * 200 + 14}" y="29">{escape(name)}</text>')
    for r, (label, a, b) in enumerate(rows):
        y = top + r * (2 * bar_h + gap)
        body.append(f'<text x="4" y="{y + bar_h + 4:.1f}">{escape(label)}</text>')
        for i, v in enumerate((a, b)):
            w = max(v * scale, 0.0)
            yy = y + i * bar_h
            body.append(f'<rect class="pair" x="{left}" y="{yy:.1f}" width="{w:.1f}" height="{bar_h - 1}" '
                        f'fill="{PAIR_COLORS[i]}"><title>{escape(names[i])} {escape(label)}: {v:.4g} {unit}</title></rect>'
                        f'<text x="{left + w + 4:.1f}" y="{yy + bar_h - 1:.1f}" font-size="9">{v:.3g}</text>')
    return _svg(width, top + len(rows) * (2 * bar_h + gap) + 4, body, title)
