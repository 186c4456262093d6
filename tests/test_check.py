"""``fairscale check`` / ``parallelize(check=True)``: one step of a plan on CPU ranks against one
process, per-loss and per-gradient, naming the first module whose gradient differs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale import cli
from fairscale.check import CheckFailed, RandomOpsError, backward_order, quiet_copy, random_ops
from fairscale.testing.models import build
from passes.ops import dp_ops
from planner.capture import capture
from planner.plan import DataParallel, Mesh, Plan, Schedule, TensorParallel

FACTORIES = Path(__file__).parent


def gpt() -> Any:
    return build("gpt")  # 4 blocks, tied embedding; float32


def test_a_3d_plan_matches_one_process() -> None:
    """pp 2 × dp 2 × tp 2 with microbatches and ZeRO: ParallelModule.full_grads gathers every
    gradient over stages, dp shards and tp slices in the user's keys, within float32 tolerance."""
    case = gpt()
    report = fairscale.check(case.model, case.make_batch(0, 8), devices=8, loss_fn=case.loss_fn,
                             constraints={"mesh": {"pp": 2, "dp": 2, "tp": 2}, "schedule": {"microbatches": 2},
                                          "data_parallel": {"kind": "zero2"}})
    assert report.ok, report.describe()
    mesh = report.plan.mesh
    assert (mesh.pp, mesh.dp, mesh.tp) == (2, 2, 2) and report.batch_rows == 8
    names = {k for k, p in case.model.named_parameters()}
    assert {d.key for d in report.comparison.grads} == names
    text = report.describe()
    assert "pp=2 dp=2 tp=2" in text and "on 8 CPU ranks against one process, global batch of 8" in text
    assert "MATCH: 1 loss(es), %d gradient tensors" % len(names) in text
    assert max(d.error for d in report.comparison.grads) < 1e-5  # ~5 ulps measured; tolerance 6.1e-5


def _forget_average_of_first_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """A data-parallel bug: the first gradient bucket (the last layers, reduced first in backward)
    is summed over ranks but not divided by their number."""
    finish = dp_ops._Reduction.finish

    def buggy(self: Any) -> tuple[Any, ...]:
        out = finish(self)
        return tuple(g * self.bucket.n if g is not None and self.bucket.index == 0 else g for g in out)

    monkeypatch.setattr(dp_ops._Reduction, "finish", buggy)


SMALL_BUCKETS = Plan(mesh=Mesh(dp=2), schedule=Schedule(global_batch=8),
                     data_parallel=DataParallel(kind="ddp", bucket_mb=0.01))


def test_a_backward_bug_is_caught_and_placed(monkeypatch: pytest.MonkeyPatch) -> None:
    case = gpt()
    _forget_average_of_first_bucket(monkeypatch)
    report = fairscale.check(case.model, case.make_batch(0, 8), devices=2, loss_fn=case.loss_fn, plan=SMALL_BUCKETS)
    assert not report.ok
    c = report.comparison
    assert c.losses[0].ok, "a backward bug leaves the loss alone"
    bad = [d for d in c.grads if not d.ok]
    assert bad and all(d.error > 0.5 for d in bad)  # twice the gradient: ‖Δ‖ = ‖g‖ (less under the floor)
    first = c.first_bad()
    assert first is not None and first is bad[0] and first.key == c.grads[0].key  # the last module to run
    assert c.grads[-1].ok, "the first layers are in later buckets, which are right"
    text = report.describe()
    assert text.splitlines()[1].startswith("DIFFERENT")
    assert (f"first module whose gradient differs (walking back from the loss, the order backward computes "
            f"gradients): {first.module}") in text


def _parallelize_checked(rank: int, world: int) -> tuple[str, str]:
    case = gpt()
    batch = case.make_batch(0, 8)
    pm = fairscale.parallelize(case.model, example_inputs=batch, loss_fn=case.loss_fn, plan=SMALL_BUCKETS,
                               check=True)
    ok = pm.check_report.describe()
    pm.train_step(batch)  # the checked module trains
    mp = pytest.MonkeyPatch()
    _forget_average_of_first_bucket(mp)
    try:
        fairscale.parallelize(case.model, example_inputs=batch, loss_fn=case.loss_fn, plan=SMALL_BUCKETS,
                              check=True)
        failed = "not raised"
    except CheckFailed as exc:
        failed = str(exc)
    finally:
        mp.undo()
    return ok, failed


def test_parallelize_check_true_reports_and_raises_on_every_rank() -> None:
    results = fairscale.launch(_parallelize_checked, devices=2)
    assert all(ok.splitlines()[1].startswith("MATCH") for ok, _ in results)
    assert len({failed for _, failed in results}) == 1
    assert "DIFFERENT" in results[0][1] and "first module whose gradient differs" in results[0][1]


class _Dropouts(nn.Module):
    def __init__(self, functional_p: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(8, 2)
        self.functional_p = functional_p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.fc(x)))
        return self.out(F.dropout(h, p=self.functional_p, training=self.training))


def test_dropout_modules_are_turned_off_and_other_randomness_refused() -> None:
    batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
    model = _Dropouts()
    quiet, names = quiet_copy(model)
    assert names == ["drop"] and quiet.drop.p == 0.0 and model.drop.p == 0.1  # the user's model is untouched
    assert random_ops(capture(model, batch, loss_fn=F.cross_entropy, annotate=False).gm) == [
        "drop (aten.dropout.default, p=0.1)"]
    assert random_ops(capture(quiet, batch, loss_fn=F.cross_entropy, annotate=False).gm) == []
    with pytest.raises(RandomOpsError, match=r"at <model top level> \(aten.dropout.default, p=0.1\)"):
        fairscale.check(_Dropouts(functional_p=0.1), batch, devices=2, loss_fn=F.cross_entropy,
                        plan=Plan(mesh=Mesh(dp=2), schedule=Schedule(global_batch=4)))


def test_backward_order_is_reverse_first_use() -> None:
    case = gpt()
    graph = capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn, annotate=False)
    order = backward_order(graph)
    assert set(order[-2:]) == {"wte.weight", "wpe.weight"}  # the embeddings run first, get gradients last
    assert order.index("layers.3.mlp.down_proj.weight") < order.index("layers.0.attn.q_proj.weight")


def test_cli_check(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(FACTORIES))
    assert cli.main(["check", "cli_factories:gpt", "--devices", "2", "--global-batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "checking GPT from cli_factories:gpt on 2 CPU ranks (the searched plan, global batch 4)" in out
    assert "MATCH: 1 loss(es)" in out
    bad = tmp_path / "bad.json"
    Plan(mesh=Mesh(dp=2, tp=2), schedule=Schedule(global_batch=8),
         tensor_parallel=TensorParallel(rules={"layers.*.up": "colwise"})).save(bad)
    assert cli.main(["check", "check_factories:inplace_residual", "--devices", "4", "--plan", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "the plan does not compile" in err and "r += h" in err
    assert cli.main(["check", "cli_factories:gpt", "--devices", "2", "--plan", str(bad),
                     "--constraints", "{}"]) == 2
    assert "give one of them" in capsys.readouterr().err


class _GPT2Default(nn.Module):
    """Hugging Face GPT-2 with its default config values (dropout 0.1, use_cache), shrunk in size."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        self.inner = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, labels=labels).loss


@pytest.mark.slow
def test_default_gpt2_with_dropout_and_mixtral_with_experts_split() -> None:
    """Dropout modules are turned off in both runs (GPT-2's defaults have seven); Mixtral's experts
    split over ep = 2 groups of the dp ranks are gathered back by full_grads."""
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    report = fairscale.check(_GPT2Default(), (ids, ids), devices=4,
                             plan=Plan(mesh=Mesh(dp=4), schedule=Schedule(global_batch=8),
                                       data_parallel=DataParallel(kind="fsdp", units="inner.transformer.h.*")))
    assert report.ok, report.describe()
    assert len(report.dropout_off) == 7 and "dropout off in both runs (7 module(s)" in report.describe()
    case = build("mixtral")
    report = fairscale.check(case.model, case.make_batch(0, 8), devices=4, loss_fn=case.loss_fn,
                             constraints={"mesh": {"pp": 1, "dp": 4, "tp": 1, "ep": 2}})
    assert report.ok and report.plan.mesh.ep == 2, report.describe()
