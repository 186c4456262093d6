"""The search's compile hook (``search(compiles=...)``): it never returns a refused plan, falls
back to the next mesh, records every refusal, and says so when nothing compiles. The planner is
pure, so the check here is a plain function of the plan (the real one is fairscale.compile_check)."""

from __future__ import annotations

import pytest

from planner.cluster import Cluster
from planner.cost_gpt import gpt_graph
from planner.plan import Plan
from planner.search import NoCompilablePlan, search

GRAPH = gpt_graph(layers=8, hidden=1024, heads=16, seq=512, vocab=8000)
CLUSTER = Cluster.preset("a100-80gb", nodes=2)


def mesh(plan: Plan) -> tuple[int, int, int]:
    return plan.mesh.pp, plan.mesh.dp, plan.mesh.tp


def run(compiles=None, **kw):
    return search(GRAPH, CLUSTER, global_batch=64, compiles=compiles, **kw)


def test_without_a_refusal_the_result_is_unchanged() -> None:
    plain, checked = run(), run(compiles=lambda plan: None)
    assert mesh(plain.plan) == mesh(checked.plan)
    assert [mesh(c.plan) for c in plain.runners_up] == [mesh(c.plan) for c in checked.runners_up]
    assert checked.refused == [] and "refused" not in checked.table()


def test_a_refused_winner_gives_way_to_the_next_mesh_and_is_recorded() -> None:
    plain = run()
    bad = mesh(plain.plan)
    seen: list[tuple[int, int, int]] = []

    def compiles(plan: Plan) -> str | None:
        seen.append(mesh(plan))
        return "TPShardError: in-place add_ would need its input converted" if mesh(plan) == bad else None

    result = run(compiles)
    assert seen[0] == bad, "the search checks its fastest plan first"
    assert mesh(result.plan) == mesh(plain.runners_up[0].plan)
    assert bad not in [mesh(c.plan) for c in [result.best, *result.runners_up]]
    assert [mesh(c.plan) for c in result.refused] == [bad]
    assert result.refused[0].refused.startswith("TPShardError")
    assert "refused: pp=%d dp=%d tp=%d" % bad in result.table()
    assert "in-place add_ would need its input converted" in result.table()
    assert all(not c.refused for c in [result.best, *result.runners_up])
    assert result.runners_up
    assert any(word in result.runners_up[0].reason for word in ("slower", "ties"))  # against the new winner


def test_every_kept_mesh_refused_runs_branch_and_bound_again_without_them() -> None:
    """Refuse every plan with tp > 1 or pp > 1: the kept meshes are all of that kind, so the
    search must go back and find a pure data-parallel plan it had pruned."""
    def compiles(plan: Plan) -> str | None:
        return None if plan.mesh.tp == 1 and plan.mesh.pp == 1 else "refused for the test"

    plain = run(top_k=1)
    assert any(m[0] > 1 or m[2] > 1 for m in map(mesh, [plain.plan, *[c.plan for c in plain.runners_up]]))
    result = run(compiles, top_k=1)
    assert (result.plan.mesh.pp, result.plan.mesh.tp) == (1, 1)
    assert result.refused and all(c.plan.mesh.tp > 1 or c.plan.mesh.pp > 1 for c in result.refused)


def test_nothing_compiles_raises_with_every_reason() -> None:
    with pytest.raises(NoCompilablePlan) as info:
        run(lambda plan: f"stage split: cut before in-place relu_ (mesh pp={plan.mesh.pp})")
    err = info.value
    assert err.refused and len({mesh(c.plan) for c in err.refused}) == len(err.refused)
    assert "every plan that fits in memory was refused before launch" in str(err) and "cut before in-place relu_" in str(err)


def test_one_reason_for_every_mesh_is_said_once() -> None:
    with pytest.raises(NoCompilablePlan) as info:
        run(lambda plan: "the loss couples the rows")
    assert len(info.value.refused) > 1
    assert str(info.value).count("the loss couples the rows") == 1
    assert "all for one reason: the loss couples the rows" in str(info.value)


def test_a_constrained_search_whose_only_mesh_is_refused_says_why() -> None:
    with pytest.raises(NoCompilablePlan, match="pp=2 dp=4 tp=2.*the reason"):
        run(lambda plan: "the reason", constraints={"mesh": {"pp": 2, "dp": 4, "tp": 2}})


@pytest.mark.parametrize("refuse_winner", [False, True], ids=["winner-compiles", "winner-refused"])
def test_checking_only_the_winner_gives_the_same_plan_with_fewer_checks(refuse_winner: bool) -> None:
    """``check_runners_up=False`` (fairscale.plan, parallelize, ``fairscale plan``): the same
    winner as checking every plan, one check when it compiles, and the runners-up costed but
    marked unchecked, none of them a refused mesh."""
    bad = mesh(run().plan) if refuse_winner else None
    seen: list[tuple[int, int, int]] = []

    def compiles(plan: Plan) -> str | None:
        seen.append(mesh(plan))
        return "refused for the test" if mesh(plan) == bad else None

    full = run(compiles)
    seen.clear()
    quick = run(compiles, check_runners_up=False)
    assert mesh(quick.plan) == mesh(full.plan)
    assert seen == ([bad] if refuse_winner else []) + [mesh(quick.plan)]
    assert quick.best.checked and quick.runners_up and not any(c.checked for c in quick.runners_up)
    assert [mesh(c.plan) for c in quick.runners_up] == [mesh(c.plan) for c in full.runners_up][:len(quick.runners_up)]
    assert bad not in [mesh(c.plan) for c in quick.runners_up]
    assert "(compile check not run)" in quick.table()
