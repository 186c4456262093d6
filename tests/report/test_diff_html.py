"""`fairscale diff a.json b.json --html out.html`: two plans side by side, per term and per stage."""

from __future__ import annotations

import re
from html import unescape
from pathlib import Path

import pytest

from fairscale import cli
from fairscale.api import captured
from fairscale.report.compare import render_diff_html
from fairscale.report.build import report_data
from fairscale.testing.models import build
from fairscale.whatif import diff_plans
from planner.cluster import Cluster
from planner.plan import Mesh, Plan, Schedule, Stage

FACTORIES = Path(__file__).parent.parent / "cli_factories.py"


def _cells(page: str, cls: str) -> list[list[str]]:
    table = re.search(rf'<table class="{cls}">(.*?)</table>', page, re.S).group(1)
    return [[unescape(c) for c in re.findall(r"<td>(.*?)</td>", row)] for row in re.findall(r"<tr>(.*?)</tr>", table)][1:]


def test_the_page_shows_both_plans_per_term_and_per_stage():
    case = build("gpt")
    graph = captured(case.model, case.make_batch(0, 8), loss_fn=case.loss_fn)
    names = [layer.name for layer in graph.layers]
    pp2 = Plan(mesh=Mesh(pp=2, dp=1, tp=1), schedule=Schedule(kind="1f1b", microbatches=4, global_batch=8),
               stages=[Stage(layers=", ".join(names[:4])), Stage(layers=", ".join(names[4:]))])
    dp2 = Plan(mesh=Mesh(pp=1, dp=2, tp=1), schedule=Schedule(kind="1f1b", microbatches=1, global_batch=8))
    cluster = Cluster.cpu(2)
    diff = diff_plans(pp2, dp2, graph, cluster, names=("pp2.json", "dp2.json"))
    page = render_diff_html(diff, report_data(pp2, graph, cluster, title="pp2.json"),
                            report_data(dp2, graph, cluster, title="dp2.json"))
    terms = {row[0]: row[1:] for row in _cells(page, "terms")}
    for term, a, b in [*diff.rows(), ("step", diff.a.step_time_s, diff.b.step_time_s)]:
        assert terms[term][:2] == [f"{a * 1e3:.4g}", f"{b * 1e3:.4g}"], term
    stages = _cells(page, "stages")
    assert [row[0] for row in stages] == ["stage 0", "stage 1"]
    assert stages[1][1:] == [f"{diff.a.stage_f_s[1] * 1e3:.4g}", f"{diff.a.stage_b_s[1] * 1e3:.4g}", "", ""]
    assert stages[0][3] == f"{diff.b.stage_f_s[0] * 1e3:.4g}"
    assert ["mesh.pp", "2", "1"] in _cells(page, "fields")
    assert page.count('class="pair"') == 2 * len(terms)
    for fig in ('id="mesh-a"', 'id="mesh-b"', 'id="memory-a"', 'id="memory-b"', 'id="timeline-a"'):
        assert fig in page
    assert 'id="timeline-b"' not in page  # dp2 has no pipeline
    assert "<script" not in page and "https://" not in page


def test_the_command_writes_the_page(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(FACTORIES.parent))
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "diff.html"
    assert cli.main(["plan", "cli_factories:gpt", "--devices", "4", "-o", str(a)]) == 0
    assert cli.main(["plan", "cli_factories:gpt", "--devices", "4", "-o", str(b),
                     "--constraints", '{"mesh": {"pp": 1}}']) == 0
    capsys.readouterr()
    assert cli.main(["diff", str(a), str(b), "--html", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    page = out.read_text()
    assert "<h1>a.json against b.json</h1>" in page and 'id="mesh-a"' in page and 'id="mesh-b"' in page
    assert ["mesh.pp", "2", "1"] in _cells(page, "fields")
