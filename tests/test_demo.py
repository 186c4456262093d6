"""The README's first command: `python -m fairscale demo` plans, reports, trains on CPU ranks,
matches one process, and states its predicted against its measured step time."""

from __future__ import annotations

from pathlib import Path

import pytest

from fairscale.demo import main


def test_demo_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    html = tmp_path / "plan.html"
    assert main(["--devices", "4", "--steps", "20", "--batch", "16", "--mesh", "2,2,1", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "matches within 1e-5" in out and html.is_file()
    assert "step time: predicted " in out and "(cpu)" in out  # the tests plan with the default CPU figures
    assert "costed for CPU ranks with default rates, not measured here" in out
    # and the error term by term (fairscale.closed_loop.term_table): both pipeline ranks, the optimizer
    assert "compute, pipeline rank 1" in out and "optimizer step" in out and "predicted" in out
