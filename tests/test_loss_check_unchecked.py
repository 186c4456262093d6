"""A loss neither the proof on the graph nor the eager check can judge is refused for plans that
cut the batch, and the eager check runs on the user's model itself (no copy) unless its forward
writes a parameter.

The proof (``planner.row_flow``) has no rule for an FFT along a row's own values: the models here
use one so that the eager check must decide. Before, a model the eager check could not run
(a forward that returns predictions in eval mode) or could not weigh (no labels in the rows it
took) was trusted: its batch-cutting plans launched unchecked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.loss_check import proven_row_by_row
from planner.plan import PlanError

DP2 = {"mesh": {"pp": 1, "dp": 2, "tp": 1}}
RAN_ON: list[int] = []


class Classifier(nn.Module):
    """Row by row, but unproven (an FFT over features); ``eval_returns`` what an eval-mode
    forward returns: the loss, or the predictions (a detection model's habit)."""

    def __init__(self, *, eval_returns: str = "loss", couple: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 5)
        self.eval_returns, self.couple, self.calls = eval_returns, couple, 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        RAN_ON.append(id(self))
        self.calls += 1
        h = torch.fft.rfft(self.lin(x), n=8).abs()[:, :5]
        if self.couple:
            h = h - h.mean(0)  # a batch statistic: the rows are coupled
        if not self.training and self.eval_returns == "predictions":
            return h.argmax(-1)
        return F.cross_entropy(h, y, ignore_index=-100)


class TrainingOnlyAux(Classifier):
    """A load-balancing term over the whole batch, added in training only (fairseq's and the Switch
    Transformer's MoE habit): it couples the rows, and an eval-mode run never sees it."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = super().forward(x, y)
        if self.training:
            share = self.lin(x).softmax(-1).mean(0)
            loss = loss + 0.1 * (share * share).sum() * share.numel()
        return loss


def _batch(ignored_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g)
    y[:ignored_rows] = -100
    return x, y


def _plan(model: nn.Module, batch: tuple[torch.Tensor, ...], constraints: dict | None = None) -> fairscale.Plan:
    return fairscale.plan(model, batch, devices=2, constraints=constraints)


def test_the_models_here_are_not_proven_on_the_graph() -> None:
    assert not proven_row_by_row(Classifier(), _batch(), None)


def test_a_model_that_does_not_run_in_eval_mode_is_refused_for_a_plan_that_cuts_the_batch() -> None:
    with pytest.raises(PlanError) as e:
        _plan(Classifier(eval_returns="predictions"), _batch(), DP2)
    said = str(e.value)
    assert "could not be checked to be computed row by row" in said and "eval mode" in said, said
    assert "mesh.dp 1" in said and "make the model's forward run on them" in said, said


def test_the_search_keeps_such_a_batch_whole() -> None:
    plan = _plan(Classifier(eval_returns="predictions"), _batch())
    assert plan.mesh.dp == 1 and plan.schedule.microbatches == 1, plan.to_dict()


def test_rows_that_count_no_labels_are_passed_over() -> None:
    assert _plan(Classifier(), _batch(ignored_rows=4), DP2).mesh.dp == 2  # rows 0-3 count none
    with pytest.raises(PlanError, match="the loss is not computed row by row: on the example batch, rows 2-5"):
        _plan(Classifier(couple=True), _batch(ignored_rows=4), DP2)


def test_a_batch_that_counts_no_labels_is_refused() -> None:
    with pytest.raises(PlanError, match="count no labels.*give an example batch with labels in every row"):
        _plan(Classifier(), _batch(ignored_rows=8), DP2)


def test_the_check_runs_on_the_users_model_and_leaves_its_attributes_as_they_were() -> None:
    model = Classifier()
    RAN_ON.clear()
    _plan(model, _batch(), DP2)
    assert RAN_ON and set(RAN_ON) == {id(model)}  # no copy: the planning rank holds the weights once
    assert model.calls == 0 and model.training


def test_a_coupling_term_added_in_training_only_is_refused_for_a_plan_that_cuts_the_batch() -> None:
    """The eager check ran in eval mode only: it saw a row-by-row loss, and dp2 trained to other
    numbers. Where the two modes' graphs part, it runs in training mode now."""
    with pytest.raises(PlanError) as e:
        _plan(TrainingOnlyAux(), _batch(), DP2)
    said = str(e.value)
    assert "the loss is not computed row by row" in said, said
    assert "run in training mode, its random draws constant (its code takes another path in eval mode" in said, said
    assert "test_loss_check_unchecked.py" in said, said
    assert _plan(TrainingOnlyAux(), _batch()).mesh.dp == 1


class Jittered(Classifier):
    """Noise only while training, row by row (a router's jitter), and dropout: random draws the
    training-mode check makes constant."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = F.dropout(x * (1 + 0.01 * torch.rand_like(x)) + 0.01 * torch.randn_like(x), 0.1)
        return super().forward(x, y)


def test_noise_added_in_training_only_row_by_row_is_not_refused() -> None:
    assert _plan(Jittered(), _batch(), DP2).mesh.dp == 2
