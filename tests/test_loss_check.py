"""A loss that is not computed row by row is refused for plans that cut the batch (fairscale.loss_check).

A contrastive loss with in-batch negatives under dp2 trained silently to other numbers (each rank
saw only its own rows as negatives: 3.45 against 5.22 at the first step), and so did a sum over the
rows written by hand (at 1 / dp of its gradient). The compile check now computes the loss of two
pieces of the plan's rows against both together on the example batch, so the search keeps the
batch whole for such a model and a hand-written plan that cuts it is refused before launch.

The losses alone missed a mean over a selection the data sizes: HF ``ElectraForPreTraining`` given
an attention mask takes ``logits[mask]`` and averages binary cross entropy over the kept tokens.
At initialization every token's loss is about ``log 2``, so the pieces' mean of means matched the
batch's mean (0.69133 against 0.69129), and pp2 x tp2, pp2 x dp2 and FSDP over 4 ranks trained to
other numbers (gradients 11-21% off). The check compares the gradients too now.

A token mean beside other terms (HF ``BertForPreTraining``: masked-LM plus next-sentence loss;
``*ForQuestionAnswering`` with positions past the sequence, which its loss ignores) cannot be
reweighted when the pieces count different labels, and the runtime refuses such a step on every
rank. With masked-LM labels that is every step: ``parallelize(model, devices=4)`` searched a dp4
plan and crashed at its first step. The example batch is now counted as the plan cuts it, before
launch: such a plan is refused there, and the search keeps the batch whole.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.loss_check import row_problem
from passes.loss_weights import token_counter
from planner.capture import capture
from planner.plan import PlanError


class Contrastive(nn.Module):
    """CLIP-style: two towers, cross entropy over the in-batch similarity matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        za, zb = F.normalize(self.a(x), dim=-1), F.normalize(self.b(y), dim=-1)
        return F.cross_entropy(za @ zb.t() / 0.1, torch.arange(x.shape[0]))


class RowWise(nn.Module):
    """Batch norm and dropout in training mode, a token mean with ignored labels: row by row in eval."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y, ignore_index=3)


class MaskedTokenMean(nn.Module):
    """A per-token binary loss averaged over the tokens the data keeps, ElectraForPreTraining's way."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.score = nn.Embedding(32, 16), nn.Linear(16, 1)
        nn.init.normal_(self.score.weight, std=1e-3)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.score(self.embed(ids)).squeeze(-1)
        keep = ids != 0  # padding
        return F.binary_cross_entropy_with_logits(logits[keep], labels[keep].float())


def _padded(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of 2 to 8 tokens, padded with 0 to 8, and a 0/1 label per token."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, 32, (8, 8), generator=g)
    lengths = torch.tensor([2, 3, 8, 7, 8, 2, 5, 4])
    ids = torch.where(torch.arange(8)[None] < lengths[:, None], ids, torch.zeros_like(ids))
    return ids, torch.randint(0, 2, (8, 8), generator=g)


def _batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _problem(model: nn.Module, batch: tuple[Any, ...], loss_fn: Any = None, rows: int = 2) -> str | None:
    counter = token_counter(capture(model, batch, loss_fn=loss_fn, annotate=False).gm)
    return row_problem(model, batch, loss_fn, counter, rows)


def test_row_by_row_losses_pass_and_coupled_or_hand_summed_ones_do_not() -> None:
    torch.manual_seed(0)
    x, y = _batch()
    assert _problem(RowWise(), (x, y)) is None
    assert _problem(nn.Linear(16, 4), (x, y), loss_fn=F.cross_entropy) is None
    assert _problem(nn.Linear(16, 4), (x, y), loss_fn=lambda out, t: F.cross_entropy(out, t, reduction="sum")) is None
    coupled = _problem(Contrastive(), (x, torch.randn(8, 16)))
    assert coupled is not None and "not computed row by row" in coupled and "keeps the batch whole" in coupled
    by_hand = _problem(nn.Linear(16, 4), (x, y), loss_fn=lambda out, t: (out - F.one_hot(t, 4)).pow(2).sum())
    assert by_hand is not None and "the mean of the pieces' losses" in by_hand
    model = RowWise()
    assert model.training and _problem(model, (x, y)) is None and model.training  # the flags come back


def test_a_mean_over_a_data_sized_selection_is_caught_by_its_gradient_and_named() -> None:
    """Its losses agree to 1e-4 at initialization (the value check alone let it through); its
    gradients do not, and the message names the op that selects and its source line."""
    torch.manual_seed(0)
    model, batch = MaskedTokenMean(), _padded()
    gm = capture(model, batch, annotate=False).gm
    problem = row_problem(model, batch, None, token_counter(gm), 2, gm=gm)
    assert problem is not None and "their gradients differ by" in problem, problem
    assert "op aten.index.Tensor" in problem and "test_loss_check.py:" in problem and "logits[keep]" in problem
    assert not [p for p in model.parameters() if p.grad is not None]  # the check leaves .grad alone
    with pytest.raises(PlanError, match=re.escape("over a selection whose size depends on the data, made at module "
                                                  "<model top level>, op aten.index.Tensor, source test_loss_check.py:")):
        fairscale.plan(model, batch, devices=2, constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})  # (planner.row_counts)


class MaskedLMPlusRowLoss(nn.Module):
    """BertForPreTraining's loss in small: a token mean over the labels kept plus a per-row term."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.lm, self.cls = nn.Embedding(32, 16), nn.Linear(16, 32), nn.Linear(16, 2)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, nsp: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        mlm = F.cross_entropy(self.lm(h).flatten(0, 1), labels.flatten())
        return mlm + F.cross_entropy(self.cls(h[:, 0]), nsp)


def test_a_token_mean_beside_other_terms_is_counted_on_the_example_batch_before_launch() -> None:
    torch.manual_seed(0)
    ids = _padded()[0]
    kept = torch.arange(8)[None] < torch.arange(1, 9)[:, None]  # row i keeps i + 1 labels
    masked = torch.where(kept, ids, torch.full_like(ids, -100))
    nsp = torch.randint(0, 2, (8,))
    with pytest.raises(PlanError, match="on the example batch, the loss is a token mean") as info:
        fairscale.plan(MaskedLMPlusRowLoss(), (ids, masked, nsp), devices=2,
                       constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})
    assert "op aten.cross_entropy_loss.default, source test_loss_check.py:" in str(info.value), str(info.value)
    searched = fairscale.plan(MaskedLMPlusRowLoss(), (ids, masked, nsp), devices=2)
    assert searched.mesh.dp * searched.schedule.microbatches == 1, searched.mesh
    even = fairscale.plan(MaskedLMPlusRowLoss(), (ids, ids, nsp), devices=2,  # no label ignored: it trains
                          constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})
    assert even.mesh.dp == 2


def test_the_search_never_cuts_the_batch_of_a_contrastive_loss() -> None:
    """On 2 devices every mesh's best plan cuts the batch (dp2; pp2 with 2 microbatches), and the
    search gives a refused mesh up whole; after the loss check's refusal it searches again with the
    batch whole and finds the pipeline of one microbatch, saying why. A cut the user fixed stays
    refused, with the reason."""
    torch.manual_seed(0)
    batch = (torch.randn(8, 16), torch.randn(8, 16))
    result = fairscale.search(Contrastive(), batch, devices=2, dtype="fp32")
    plan = result.plan
    assert (plan.mesh.dp, plan.schedule.microbatches) == (1, 1), result.table()
    assert any("searched with the batch whole" in n and "not computed row by row" in n
               for n in plan.predicted.notes), plan.predicted.notes
    assert any("not computed row by row" in c.refused for c in result.refused), result.table()
    with pytest.raises(PlanError, match="not computed row by row"):
        fairscale.search(Contrastive(), batch, devices=2, constraints={"mesh": {"dp": 2}})
    with pytest.raises(PlanError, match="not computed row by row"):
        fairscale.search(Contrastive(), batch, devices=2, constraints={"schedule": {"microbatches": 2}})


def _contrastive_searched(rank: int, world: int) -> tuple[tuple[int, int, int, int], list[float]]:
    torch.manual_seed(0)
    pm = fairscale.parallelize(Contrastive(), example_inputs=(torch.randn(8, 16), torch.randn(8, 16)),
                               optimizer=functools.partial(torch.optim.SGD, lr=0.5))
    mesh = pm.plan.mesh
    losses = [pm.train_step((torch.randn(8, 16, generator=torch.Generator().manual_seed(s)), torch.randn(8, 16)))
              for s in range(3)]
    return (mesh.pp, mesh.dp, mesh.tp, pm.plan.schedule.microbatches), losses


def test_parallelize_without_a_plan_keeps_a_contrastive_batch_whole_and_trains_exactly() -> None:
    """On 2 ranks the search used to refuse everything; it now finds a plan of both devices with
    the batch whole, and training matches one process."""
    (mesh, losses), _ = fairscale.launch(_contrastive_searched, devices=2)
    assert mesh[1] == 1 and mesh[3] == 1 and mesh[0] * mesh[2] == 2, mesh
    torch.manual_seed(0)
    model, _x, _y = Contrastive(), torch.randn(8, 16), torch.randn(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = []
    for s in range(3):
        opt.zero_grad()
        loss = model(torch.randn(8, 16, generator=torch.Generator().manual_seed(s)), torch.randn(8, 16))
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-5)


def _contrastive_dp2(rank: int, world: int) -> str:
    torch.manual_seed(0)
    try:
        fairscale.parallelize(Contrastive(), example_inputs=(torch.randn(8, 16), torch.randn(8, 16)),
                              constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}},
                              optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    except PlanError as exc:
        return str(exc)
    return "built"


def test_parallelize_refuses_a_plan_that_cuts_a_coupled_batch_on_every_rank() -> None:
    messages = fairscale.launch(_contrastive_dp2, devices=2)
    assert all("not computed row by row" in m for m in messages), messages


def test_the_eager_check_leaves_the_models_buffers_as_they_were() -> None:
    """A forward that counts its calls or keeps an average of its activations: the check's three
    eager runs had stayed in the model (the ranks then started from a counter of 3 on rank 0)."""
    import torch.nn.functional as F

    from fairscale.loss_check import row_problem

    class Counting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("calls", torch.zeros(()))
            self.register_buffer("avg", torch.zeros(4))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            self.avg = 0.9 * self.avg + 0.1 * x.mean(0).detach()  # rebinds the buffer
            return F.mse_loss(self.lin(x), y)

    model = Counting()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = (torch.randn(4, 4), torch.randn(4, 4))
    assert row_problem(model, batch, None, None, 2) is None
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), {k: after[k] for k in ("calls", "avg")}


class CountDivided(nn.Module):
    """Hugging Face's num_items_in_batch: the summed token loss divided by a count given with the
    batch, here beside an auxiliary mean, which the pieces' losses cannot add up to."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        loss = F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten(), reduction="sum")
        return loss / count + 0.01 * x.pow(2).mean()


def test_a_sum_divided_by_a_given_count_beside_a_mean_is_refused_naming_where_the_sum_is() -> None:
    """HF LlamaForCausalLM given num_items_in_batch under dp4 x 2 microbatches was refused without a
    module or source line; the refusal names the summed loss's module, op and line, and the remedy.
    (The count-divided sum alone now plans and trains exactly: tests/runtime/test_scalar_inputs.py.)"""
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (8, 4))
    with pytest.raises(PlanError) as err:
        fairscale.plan(CountDivided(), (ids, ids, torch.tensor(32)), devices=2,
                       constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})
    text = str(err.value)
    assert "adds a sum over the batch" in text
    assert ("The loss is computed at module <model top level>, op aten.cross_entropy_loss.default, source "
            "test_loss_check.py:") in text
    assert "call it without num_items_in_batch" in text


class SupCon(nn.Module):
    """HobbitLong's SupContrast loss (one view): a row without a positive in its piece divides 0 by
    the log of an empty sum, so a one-row piece's loss is nan."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        features = F.normalize(self.net(x), dim=1)
        mask = torch.eq(labels.view(-1, 1), labels.view(1, -1)).float()
        logits = features @ features.T / 0.07
        logits = logits - logits.max(dim=1, keepdim=True)[0].detach()
        logits_mask = torch.scatter(torch.ones_like(mask), 1, torch.arange(x.shape[0]).view(-1, 1), 0)
        mask = mask * logits_mask
        log_prob = logits - torch.log((torch.exp(logits) * logits_mask).sum(1, keepdim=True))
        pairs = torch.where(mask.sum(1) < 1e-6, 1, mask.sum(1))
        return -((mask * log_prob).sum(1) / pairs).mean()


def test_a_piece_whose_loss_is_nan_is_a_difference() -> None:
    """SupContrast under dp4 x 2 microbatches of an 8-row batch (one row per piece) trained nan on
    every rank where one process trained: the check's two rows had no positive pair, so their loss
    and gradient were 0, and its comparisons (|got - want| > tol; a gradient error relative to a 0
    norm) let the pieces' nan through. Now a nan or inf in a piece is a difference."""
    torch.manual_seed(0)
    x, labels = torch.randn(8, 16), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    problem = row_problem(SupCon(), (x, labels), None, None, 1)
    assert problem is not None and "the mean of the pieces' losses (rows 0-0, 1-1) is nan" in problem, problem
    with pytest.raises(PlanError, match="is nan"):
        fairscale.plan(SupCon(), (x, labels), devices=4,
                       constraints={"mesh": {"pp": 1, "dp": 4, "tp": 1}, "schedule": {"microbatches": 2}})
    assert row_problem(nn.Linear(16, 3), (x, labels), lambda out, t: F.cross_entropy(out, t) * torch.nan,
                       None, 1) is not None  # a loss that is nan on the batch itself is not judged
