"""The plan-time compilation check (fairscale.compile_check): refused before any rank launches,
with the reason, the pass, the module path, the op and the model's source line."""

from __future__ import annotations

import gc
import resource
from pathlib import Path
from typing import Any

import pytest
import torch

import fairscale
import passes
from check_factories import InplaceResidual, inplace_residual
from fairscale import cli
from fairscale.compile_check import CompileChecker, PlanCompileError, checker_for, rank_index_sets
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage, TensorParallel

FACTORIES = Path(__file__).parent / "check_factories.py"
BAD_RULES = {"layers.[2-3].up": "colwise"}  # `r += h` with r replicated, h a shard: refused in place


def plan(**kw: Any) -> Plan:
    base: dict[str, Any] = dict(mesh=Mesh(pp=2, dp=1, tp=2), schedule=Schedule(microbatches=2, global_batch=8),
                                stages=[Stage(layers="layers.[0-1]"), Stage(layers="layers.[2-3], head")],
                                tensor_parallel=TensorParallel(rules=dict(BAD_RULES)),
                                data_parallel=DataParallel(kind="zero2"))
    base.update(kw)
    return Plan(**base)


def fresh() -> CompileChecker:
    model, batch, loss_fn = inplace_residual()
    return CompileChecker(model, batch, loss_fn=loss_fn)


def test_refusal_names_the_pass_module_op_and_source_line() -> None:
    found = fresh().refusal(plan())
    assert found is not None and not found.internal
    assert found.pass_name == "the tensor-parallel pass (passes/tp)"
    assert found.reason.startswith("TPShardError: in-place")
    assert (found.module, found.op) == ("layers.2", "aten.add_.Tensor")
    assert found.source.startswith(str(FACTORIES)) and found.source.endswith("in forward: r += h")
    assert found.stage == "pipeline stage 1 (0-based, of 2), dp rank 0 of 1, tp rank 0 of 2"
    text = found.message()
    assert text.startswith("the plan does not compile: the tensor-parallel pass (passes/tp) refused it for "
                           "pipeline stage 1")
    assert "at module layers.2, op aten.add_.Tensor; source " in text
    assert "what to do: drop or change the tensor_parallel rules of the modules in and around layers.2" in text


def test_the_same_plan_without_the_bad_rule_compiles() -> None:
    checker = fresh()
    assert checker.refusal(plan(tensor_parallel=TensorParallel(rules={}))) is None
    assert checker(plan(tensor_parallel=TensorParallel(rules={"layers.*.[up,skip]": "colwise",
                                                              "layers.*.down": "rowwise"}))) is None
    with pytest.raises(PlanCompileError, match="in forward: r \\+= h"):
        checker.check(plan())


def test_an_internal_error_is_refused_as_a_bug_at_its_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception a pass does not declare (here an IndexError) is still a refusal before
    launch, marked as a fairscale bug, at the node the pass was working on."""
    def broken_pass(gm: torch.fx.GraphModule, plan: Plan, **kw: Any) -> torch.fx.GraphModule:
        for node in gm.graph.nodes:
            if node.op == "call_function" and "relu" in str(node.target):
                raise IndexError("list index out of range")  # the bug
        return gm

    monkeypatch.setattr(passes, "shard_tensor_parallel_pass", broken_pass)
    found = fresh().refusal(plan(tensor_parallel=TensorParallel(rules={})))
    assert found is not None and found.internal
    assert found.reason == "IndexError: list index out of range"
    assert (found.module, found.op) == ("layers.0", "aten.relu.default")
    assert found.source.endswith("in forward: return self.down(torch.relu(r))")
    assert found.stage.startswith("pipeline stage 0 (0-based, of 2)")
    assert "failed on an internal error (a fairscale bug; please report it with this message)" in found.message()


def test_a_pass_needing_real_values_is_retried_on_real_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._subclasses.fake_tensor import DataDependentOutputException

    import fairscale.compile_check as cc

    calls: list[bool] = []
    real = cc._compile

    def compile_(graph, plan, stages, dp_index, tp_index, *, fake, program):  # type: ignore[no-untyped-def]
        calls.append(fake)
        if fake:
            raise DataDependentOutputException(torch.ops.aten.nonzero.default)
        return real(graph, plan, stages, dp_index, tp_index, fake=False, program=program)

    monkeypatch.setattr(cc, "_compile", compile_)
    assert fresh().refusal(plan(tensor_parallel=TensorParallel(rules={}))) is None
    assert calls == [True, False, True, False]  # two rank index sets, each retried


def test_two_rank_index_sets_cover_the_padded_ends() -> None:
    assert rank_index_sets(Plan(mesh=Mesh(dp=1, tp=1))) == [(0, 0)]
    assert rank_index_sets(Plan(mesh=Mesh(pp=2, dp=4, tp=2))) == [(0, 0), (3, 1)]


def test_verdicts_and_captures_are_cached_per_plan_and_shape() -> None:
    checker = fresh()
    p = plan()
    first = checker.refusal(p)
    p.predicted.step_time_s = 1.0  # predictions do not change what compiles
    assert checker.refusal(p) is first and len(checker._graphs) == 1
    assert checker.refusal(plan(schedule=Schedule(microbatches=1, global_batch=8))) is not None
    assert len(checker._graphs) == 2  # another microbatch shape, another capture


def test_a_plan_on_meta_compiles_without_allocating_its_shards() -> None:
    """A 1.3B-parameter GPT on meta, 4 stages of ZeRO-1 (whose pass fills replicated flat buffers
    when run on real tensors): the check runs the passes on fake tensors, so nothing near the
    model's 5 GiB is allocated."""
    from fairscale.testing.models import GPT, GPTConfig, lm_loss

    with torch.device("meta"):
        model = GPT(GPTConfig(layers=24, dim=2048, heads=16, seq=128, vocab=8192))
    ids = torch.zeros(4, 128, dtype=torch.long, device="meta")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    checker = CompileChecker(model, (ids, ids), loss_fn=lm_loss)
    p = Plan(mesh=Mesh(pp=4, dp=2, tp=1), schedule=Schedule(microbatches=2, global_batch=4),
             stages=[Stage(layers="wte, wpe, layers.[0-5]"), Stage(layers="layers.[6-11]"),
                     Stage(layers="layers.[12-17]"), Stage(layers="layers.[18-23], ln_f, lm_head")],
             data_parallel=DataParallel(kind="zero1"))
    assert checker.refusal(p) is None
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    assert grown_gib < 1.0, f"the check allocated {grown_gib:.2f} GiB"


def test_search_returns_only_plans_that_compile() -> None:
    """The face's search passes the check as the planner's hook: with the bad rule forced on
    every tp > 1 mesh, the winner and runners-up have tp = 1, and the refusals are in the table."""
    model, batch, loss_fn = inplace_residual()
    result = fairscale.search(model, batch, devices=4, loss_fn=loss_fn,
                              constraints={"tensor_parallel": {"rules": BAD_RULES}})
    assert all(c.plan.mesh.tp == 1 for c in [result.best, *result.runners_up])
    assert result.refused and all(c.plan.mesh.tp == 2 for c in result.refused)
    assert "r += h" in result.table() and "tensor-parallel pass (passes/tp) refused it" in result.table()


def _parallelize_bad(rank: int, world: int, bad: Plan) -> str:
    model, batch, loss_fn = inplace_residual()
    try:
        fairscale.parallelize(model, example_inputs=batch, loss_fn=loss_fn, plan=bad)
    except PlanCompileError as exc:
        return str(exc)
    return "built"


def test_parallelize_refuses_a_hand_edited_plan_on_every_rank_before_building() -> None:
    bad = plan(mesh=Mesh(pp=1, dp=2, tp=2), stages=[], schedule=Schedule(global_batch=8))
    messages = fairscale.launch(_parallelize_bad, devices=4, args=(bad,))
    assert len(set(messages)) == 1 and "in forward: r += h" in messages[0]


def test_cli_validate_compiles_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(FACTORIES.parent))
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    base = plan(mesh=Mesh(pp=1, dp=2, tp=2), stages=[], schedule=Schedule(global_batch=8))
    base.model.factory = "check_factories:inplace_residual"
    base.save(bad)
    base.tensor_parallel.rules = {"layers.*.[up,skip]": "colwise", "layers.*.down": "rowwise"}
    base.save(good)
    assert cli.main(["validate", str(good), "--devices", "4"]) == 0
    out = capsys.readouterr().out
    assert "compiles: 1 stage(s) × 2 rank index set(s) through every pass and the verifier" in out
    assert cli.main(["validate", str(bad), "--devices", "4"]) == 1
    err = capsys.readouterr().err
    assert f"{bad} has 1 problem" in err and "the plan does not compile" in err and "r += h" in err


def test_checkers_are_shared_per_model_and_shapes() -> None:
    model = InplaceResidual()
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    assert checker_for(model, batch) is checker_for(model, (torch.randn(8, 16), torch.randint(0, 4, (8,))))
    assert checker_for(model, batch) is not checker_for(model, (torch.randn(4, 16), torch.randint(0, 4, (4,))))
    import fairscale.compile_check as cc

    mine = [key for key in cc._CHECKERS if key[0] == id(model)]
    assert len(mine) == 2
    del model
    gc.collect()
    assert not any(key in cc._CHECKERS for key in mine), "a dead model's entries go (its address may be reused)"


def test_a_pass_remedy_is_read_through_the_exception_chain_as_its_node_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass's ``hint`` (``passes.dp.graph.DtypeError``'s remedy) raised under another exception
    is reported as its ``node`` is, from wherever in the chain it is (was: the top exception's only,
    so a wrapped remedy gave way to the pass's generic advice)."""
    from passes.dp.graph import DtypeError

    def wrapping_pass(gm: torch.fx.GraphModule, plan: Plan, **kw: Any) -> torch.fx.GraphModule:
        node = next(n for n in gm.graph.nodes if n.op == "call_function" and "relu" in str(n.target))
        try:
            raise DtypeError("mixed dtypes", hint="cast it back", node=node)
        except DtypeError as e:
            raise ValueError("the pass could not rewrite it") from e

    monkeypatch.setattr(passes, "shard_tensor_parallel_pass", wrapping_pass)
    found = fresh().refusal(plan(tensor_parallel=TensorParallel(rules={})))
    assert found is not None and found.reason == "ValueError: the pass could not rewrite it"
    assert (found.module, found.op, found.hint) == ("layers.0", "aten.relu.default", "cast it back")
