"""Plan diff and what-if (fairscale.whatif, `fairscale diff`, `fairscale what-if`): the terms come
from the cost model the search ranks by, and the commands read models and clusters like `plan`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fairscale import cli
from fairscale.api import captured, search_graph
from fairscale.testing.models import GPT, GPTConfig, lm_loss
from fairscale.whatif import TERMS, diff_plans, fit_mesh, what_if
from planner.api import resolve_cluster
from planner.cluster import Cluster
from planner.search import cost_plan

FACTORIES = Path(__file__).parent / "cli_factories.py"


@pytest.fixture(scope="module")
def gpt_on_meta():  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        model = GPT(GPTConfig(layers=8, dim=1024, heads=16, seq=1024, vocab=32000))
    ids = torch.zeros(1, 1024, dtype=torch.long, device="meta")
    graph = captured(model, (ids, ids), loss_fn=lm_loss)
    cluster = resolve_cluster("a100-80gb", devices=16)
    return graph, cluster, search_graph(graph, cluster, global_batch=256, top_k=3)


def test_diff_accounts_for_the_step_time_difference_by_term(gpt_on_meta) -> None:  # type: ignore[no-untyped-def]
    graph, cluster, result = gpt_on_meta
    a, b = result.plan, result.runners_up[0].plan
    d = diff_plans(a, b, graph, cluster)
    assert d.a.step_time_s == pytest.approx(cost_plan(a, graph, cluster).step_time_s)
    assert d.a.step_time_s <= d.b.step_time_s  # the winner is the faster one, under the same model
    rows = dict((t, (va, vb)) for t, va, vb in d.rows())
    assert set(rows) == {label for _, label in TERMS} | {"pipeline bubble"}
    text = d.text()
    assert text.startswith(f"A is faster: {d.a.step_time_s:.4g} s/step against {d.b.step_time_s:.4g} s/step")
    assert "plan fields that differ:" in text and "mesh." in text
    moved = max(rows.items(), key=lambda kv: abs(kv[1][1] - kv[1][0]))[0]
    assert f"largest differences (B against A): {moved}" in text


def test_a_plan_diffed_with_itself_differs_in_nothing(gpt_on_meta) -> None:  # type: ignore[no-untyped-def]
    graph, cluster, result = gpt_on_meta
    d = diff_plans(result.plan, result.plan, graph, cluster)
    assert not d.fields and all(va == vb for _, va, vb in d.rows())
    assert "largest differences" not in d.text()


def test_what_if_scales_data_parallelism_and_compares_with_the_search(gpt_on_meta) -> None:  # type: ignore[no-untyped-def]
    graph, _, result = gpt_on_meta
    plan = result.plan
    h100 = Cluster.preset("h100-sxm-80gb", nodes=4)
    w = what_if(plan, graph, h100, global_batch=512)
    assert w.cost is not None and w.cost.fits and w.searched is not None
    assert w.cost.step_time_s >= w.searched.best.breakdown.step_time_s * (1 - 1e-9)  # the search is no worse
    assert f"dp={plan.mesh.dp * 2}" in w.note and "the search would pick: " in w.text()
    moved, why = fit_mesh(plan, 7, 512)
    assert moved is None and "7 devices do not divide" in why or "does not split" in why


def test_the_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(FACTORIES.parent))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert cli.main(["plan", "cli_factories:gpt", "--devices", "4", "-o", str(a)]) == 0
    assert cli.main(["plan", "cli_factories:gpt", "--devices", "4", "-o", str(b),
                     "--constraints", '{"mesh": {"pp": 1}}']) == 0
    capsys.readouterr()
    assert cli.main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "s/step against" in out and "mesh.pp: 2 -> 1" in out and "pipeline bubble" in out
    assert cli.main(["what-if", str(a), "--cluster", "a100-80gb", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "on 8 × NVIDIA A100-SXM4-80GB" in out and "the search would pick" in out
    assert cli.main(["what-if", str(a)]) == 2
    assert "what-if needs the other hardware" in capsys.readouterr().err
    # costed in another dtype, the plan is costed from the model traced in that dtype (fairscale.api.captured)
    traced: list[str] = []

    def spy(*args, dtype: str = "fp32", **kwargs):  # type: ignore[no-untyped-def]
        traced.append(dtype)
        return captured(*args, dtype=dtype, **kwargs)
    monkeypatch.setattr(cli, "captured", spy)
    assert cli.main(["what-if", str(a), "--cluster", "a100-80gb", "--devices", "8", "--dtype", "bf16",
                     "--no-search"]) == 0
    assert traced == ["bf16"], traced
    # a diff of plans in two dtypes costs each from the trace in its own dtype
    c = tmp_path / "c.json"
    assert cli.main(["plan", "cli_factories:gpt", "--devices", "4", "-o", str(c), "--dtype", "bf16"]) == 0
    traced.clear()
    capsys.readouterr()
    assert cli.main(["diff", str(a), str(c)]) == 0
    assert traced == ["fp32", "bf16"], traced
    assert "data_parallel.param_dtype: 'fp32' -> 'bf16'" in capsys.readouterr().out
