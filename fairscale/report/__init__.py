"""Plan reports: the text table ``pm.report()`` prints, and an offline HTML file with SVG pictures."""

from fairscale.report.html import ReportData, render_html, write_html
from fairscale.report.svg import Box

__all__ = ["ReportData", "Box", "render_html", "write_html"]
