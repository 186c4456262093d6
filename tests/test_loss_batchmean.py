"""A sum over the batch divided by the batch's rows is a mean over rows, not a sum.

Hinton's distillation as PyTorch writes it, ``nn.KLDivLoss(reduction="batchmean")`` beside a cross
entropy, and the VAE of pytorch/examples as its forks write it, ``(bce_sum + kld_sum) / x.size(0)``,
were refused for every plan that cuts the batch ("the loss adds a sum over the batch
(aten.kl_div.default) to other terms"): ``passes.loss_weights.token_counter`` saw the summing loss
op and not the division by the rows that follows it. A piece divides by its own rows, so the
pieces' mean is the batch's loss; dp2 x 2 microbatches trains as one process.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.testing.models import Case
from fairscale.testing.reference import RankResult, compare_grads, rank_trajectory, train_on_rank, train_reference
from passes.loss_weights import token_counter
from planner.capture import capture

CONSTRAINTS = {"mesh": {"pp": 1, "dp": 2, "tp": 1}, "schedule": {"microbatches": 2}}


class Distill(nn.Module):
    """A frozen teacher, a student, KL batchmean times T^2 plus CE."""

    def __init__(self, divisor: float | None = None) -> None:
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 6))
        self.teacher.requires_grad_(False)
        self.student = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 6))
        self.divisor = divisor

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = self.teacher(x)
        s = self.student(x)
        if self.divisor is None:
            kd = nn.KLDivLoss(reduction="batchmean")(F.log_softmax(s / 4, dim=1), F.softmax(t / 4, dim=1))
        else:
            kd = F.kl_div(F.log_softmax(s / 4, dim=1), F.softmax(t / 4, dim=1), reduction="sum") / self.divisor
        return kd * 16 * 0.9 + F.cross_entropy(s, labels) * 0.1


def _batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 12, generator=g), torch.randint(0, 6, (rows,), generator=g)


def _case() -> Case:
    torch.manual_seed(0)
    return Case("distill", Distill(), _batch, None)


def test_a_sum_divided_by_the_rows_is_not_counted_as_a_sum() -> None:
    torch.manual_seed(0)
    counter = token_counter(capture(Distill(), _batch(0), annotate=False).gm)
    assert counter is not None and counter.kind == "mean"  # the cross entropy beside it, its labels all kept
    fixed = token_counter(capture(Distill(divisor=5.0), _batch(0), annotate=False).gm)
    assert fixed is not None and fixed.kind == "sum" and not fixed.exact  # a divisor that is not the rows
    plan = fairscale.plan(Distill(), _batch(0), devices=2, constraints=CONSTRAINTS)
    assert (plan.mesh.dp, plan.schedule.microbatches) == (2, 2)


def _train(rank: int, world: int) -> RankResult:
    return train_on_rank(_case(), constraints=CONSTRAINTS, optimizer=functools.partial(torch.optim.SGD, lr=0.1))


def test_distillation_with_batchmean_trains_exactly_under_dp2_and_2_microbatches() -> None:
    reference = train_reference(_case, steps=3, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    compare_grads(reference, rank_trajectory(fairscale.launch(_train, devices=2)[0]))


class TokenKD(nn.Module):
    """Distillation per token as language-model code writes it: ``kl_div`` of the logits flattened
    to ``(rows x positions, V)`` with ``reduction="batchmean"``, which divides the sum by rows x
    positions (``loss_scale`` a number times a sum instead, ``scaled_sum``)."""

    def __init__(self, kind: str = "batchmean") -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 6))
        self.kind = kind

    def forward(self, x: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(self.student(x), dim=-1)
        if self.kind == "batchmean":
            return F.kl_div(logp.view(-1, 6), teacher.view(-1, 6), reduction="batchmean")
        if self.kind == "half":
            return 0.5 * F.mse_loss(logp, teacher, reduction="sum")
        return F.kl_div(logp, teacher, reduction="sum") / 7.0


def _token_batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 5, 12, generator=g), torch.softmax(torch.randn(rows, 5, 6, generator=g), dim=-1)


def _token_case(kind: str) -> Case:
    torch.manual_seed(0)
    return Case(f"token-kd-{kind}", TokenKD(kind), _token_batch, None)


KINDS = ("batchmean", "half", "over7")


def _train_tokens(rank: int, world: int) -> list[RankResult]:
    return [train_on_rank(_token_case(kind), constraints=CONSTRAINTS,
                          optimizer=functools.partial(torch.optim.SGD, lr=0.1)) for kind in KINDS]


def test_a_batchmean_over_tokens_and_a_sum_times_a_number_train_exactly_under_dp2_and_2_microbatches() -> None:
    """``kl_div(logits.view(-1, V), ..., reduction="batchmean")`` divides by rows x positions, a
    multiple of the rows: a mean over rows. ``0.5 * mse_sum`` and ``kl_sum / 7`` are sums. All
    three were refused for every plan that cuts the batch, 'the loss adds a sum over the batch
    (aten.kl_div.default) to other terms', though they have no other term."""
    counters = {kind: token_counter(capture(TokenKD(kind), _token_batch(0), annotate=False).gm) for kind in KINDS}
    assert counters["batchmean"] is None  # a plain mean over rows
    assert all(counters[k] is not None and counters[k].kind == "sum" and counters[k].exact for k in ("half", "over7"))
    results = fairscale.launch(_train_tokens, devices=2)[0]
    for kind, result in zip(KINDS, results):
        reference = train_reference(lambda k=kind: _token_case(k), steps=3,
                                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        compare_grads(reference, rank_trajectory(result))
