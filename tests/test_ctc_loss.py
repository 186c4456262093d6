"""Models trained with CTC capture and train exactly under data parallelism and microbatches.

An ESPnet-style conformer with ``F.ctc_loss(log_probs, ys_pad, hlens, ys_lens, reduction="mean")``
was refused for every plan, "could not capture ConformerCTC: its forward needs a tensor's value ...
torch.export: DynamicOutputShapeException: aten._ctc_loss.Tensor", advising a ``torch.where`` the
user cannot write; a wav2vec-style model then fell back to torch.fx, which kept its
``nn.TransformerEncoder`` whole, and every plan failed the verifier. ``planner.ctc_capture`` traces
the loss as one op per row (``fairscale::ctc_loss_rows``, torch's kernel) and reduces as ATen does,
so "mean" (each row divided by its target length, then the mean over rows) is cut by rows exactly.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.testing.models import Case
from fairscale.testing.reference import RankResult, compare_grads, rank_trajectory, train_on_rank, train_reference
from planner.capture import capture

CONSTRAINTS = {"mesh": {"pp": 1, "dp": 2, "tp": 1}, "schedule": {"microbatches": 2}}


class CTCNet(nn.Module):
    """Frames -> a small encoder -> per-frame log-probabilities -> CTC (ESPnet's layout: (T, B, V))."""

    def __init__(self, reduction: str = "mean", module: bool = False) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.ctc_lo = nn.Linear(16, 5)
        self.reduction = reduction
        self.criterion = nn.CTCLoss(reduction=reduction, zero_infinity=True) if module else None

    def forward(self, xs: torch.Tensor, xlens: torch.Tensor, ys: torch.Tensor, ylens: torch.Tensor) -> torch.Tensor:
        log_probs = self.ctc_lo(self.enc(xs)).transpose(0, 1).log_softmax(2)
        if self.criterion is not None:
            return self.criterion(log_probs, ys, xlens, ylens) / ys.size(0)
        return F.ctc_loss(log_probs, ys, xlens, ylens, reduction=self.reduction, zero_infinity=True)


def _batch(step: int, rows: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 + step)
    xs = torch.randn(rows, 12, 6, generator=g)
    xlens = torch.randint(6, 13, (rows,), generator=g)
    ylens = torch.randint(1, 5, (rows,), generator=g)
    ys = torch.randint(1, 5, (rows, 4), generator=g).masked_fill(torch.arange(4) >= ylens[:, None], 0)
    return xs, xlens, ys, ylens


def _case(**kw: object) -> Case:
    torch.manual_seed(0)
    return Case("ctc", CTCNet(**kw), _batch, None)  # type: ignore[arg-type]


def test_a_ctc_loss_is_captured_as_one_loss_per_row() -> None:
    original = F.ctc_loss
    for kw in ({"reduction": "mean"}, {"reduction": "sum", "module": True}):
        model = _case(**kw).model
        gm = capture(model, _batch(0), annotate=False).gm
        assert [n for n in gm.graph.nodes if n.target is torch.ops.fairscale.ctc_loss_rows.default]
        batch = _batch(1)
        torch.testing.assert_close(gm(*batch), model(*batch), rtol=0, atol=0)
    assert F.ctc_loss is original  # put back after the trace


def test_ctc_plans_data_parallel_with_microbatches() -> None:
    plan = fairscale.plan(_case().model, _batch(0), devices=2, constraints=CONSTRAINTS)
    assert (plan.mesh.dp, plan.schedule.microbatches) == (2, 2)


def _train(rank: int, world: int) -> RankResult:
    return train_on_rank(_case(), constraints=CONSTRAINTS, optimizer=functools.partial(torch.optim.SGD, lr=0.1))


def test_ctc_mean_trains_as_one_process_under_dp2_and_2_microbatches() -> None:
    reference = train_reference(_case, steps=3, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    compare_grads(reference, rank_trajectory(fairscale.launch(_train, devices=2)[0]))


def test_a_ctc_sum_is_a_sum_over_the_batch() -> None:
    """``F.ctc_loss(..., reduction="sum")`` was refused for every plan that cuts the batch ("the loss is
    not computed row by row: ... rows 0-3 give 45.0428, but the mean of the pieces' losses ... is
    22.5214"), where cross entropy's sum plans: the capture's ``rows.sum()`` of ``fairscale::ctc_loss_rows``
    is a sum over the batch, and its pieces add up (``passes.loss_weights``)."""
    from passes.loss_weights import token_counter

    counter = token_counter(capture(_case(reduction="sum").model, _batch(0), annotate=False).gm)
    assert counter is not None and (counter.kind, counter.exact) == ("sum", True)
    plan = fairscale.plan(_case(reduction="sum").model, _batch(0), devices=2, constraints=CONSTRAINTS)
    assert (plan.mesh.dp, plan.schedule.microbatches) == (2, 2)


def _train_sum(rank: int, world: int) -> RankResult:
    return train_on_rank(_case(reduction="sum"), constraints=CONSTRAINTS,
                         optimizer=functools.partial(torch.optim.SGD, lr=0.01))


def test_ctc_sum_trains_as_one_process_under_dp2_and_2_microbatches() -> None:
    reference = train_reference(lambda: _case(reduction="sum"), steps=3, optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    compare_grads(reference, rank_trajectory(fairscale.launch(_train_sum, devices=2)[0]))
