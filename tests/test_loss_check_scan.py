"""A scan along the batch's rows (a router's capacity count over every token of the batch) is refused
for plans that cut the batch, whatever the example batch routes (``planner.row_flow.scans_over_rows``).

DeepSpeed's ``top1gating`` (and fairseq's gates) number every token of the flattened batch per expert
with ``torch.cumsum(mask, dim=0)`` and drop those past the expert's capacity. A dp slice or a
microbatch numbers only its own tokens against a capacity of its own size, so it drops others than
the batch does: under dp4 x 2 microbatches such a model (capacity factor 2, no auxiliary loss)
trained to other losses from the first step (relative error 1.9e-05, then 8.8e-05; expert
gradients 1.1% off), silently. The eager check had passed it: on its two-row pieces of the example
batch no expert overflowed, which is the common case at initialization and says nothing of a
padded batch that sends its padding to one expert.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.capture_cache import rank_capture
from fairscale.loss_check import row_problem
from planner.plan import PlanError
from planner.row_flow import scans_over_rows

DIM, EXPERTS, SEQ, VOCAB = 8, 4, 8, 16


class CapacityGate(nn.Module):
    """Top-1 routing with a capacity per expert, DeepSpeed's top1gating way: ``per_row`` counts each
    sequence's tokens on their own (the cumsum runs over the sequence), else every token of the batch."""

    def __init__(self, per_row: bool) -> None:
        super().__init__()
        self.embed, self.wg = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))
        self.head, self.per_row = nn.Linear(DIM, VOCAB), per_row

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)                                                    # (B, S, D)
        tokens = x if self.per_row else x.reshape(1, -1, DIM)                  # (rows, tokens, D)
        gates = F.softmax(self.wg(tokens), dim=-1)
        capacity = math.ceil(tokens.shape[1] / EXPERTS * 2.0)
        mask = F.one_hot(gates.argmax(-1), EXPERTS)
        locations = torch.cumsum(mask, dim=1) - 1
        keep = (mask * torch.lt(locations, capacity)).to(x.dtype) * gates
        y = sum(keep[..., e:e + 1] * expert(tokens) for e, expert in enumerate(self.experts))
        return F.cross_entropy(self.head(x + y.reshape(x.shape)).flatten(0, 1), labels.flatten())


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (8, SEQ), generator=g), torch.randint(0, VOCAB, (8, SEQ), generator=g)


def _model(per_row: bool) -> CapacityGate:
    torch.manual_seed(0)
    return CapacityGate(per_row)


def test_the_scan_over_the_batchs_tokens_is_found_and_one_over_each_sequence_is_not() -> None:
    batch = _batch()
    for per_row, expected in ((False, 1), (True, 0)):
        model = _model(per_row)
        a = rank_capture(model, tuple(t[:2] for t in batch)).gm
        b = rank_capture(model, tuple(t[:4] for t in batch)).gm
        assert len(scans_over_rows(a, b, 2, 4)) == expected, per_row


def test_plans_that_cut_the_batch_are_refused_naming_the_scan_though_the_example_batch_passes() -> None:
    batch = _batch()
    assert row_problem(_model(False), batch, None, None, 2) is None  # no expert overflows on these rows
    for constraints in ({"mesh": {"pp": 1, "dp": 2, "tp": 1}}, {"mesh": {"pp": 1, "dp": 1, "tp": 1},
                                                                "schedule": {"microbatches": 2}}):
        with pytest.raises(PlanError) as info:
            fairscale.plan(_model(False), batch, devices=constraints["mesh"]["dp"], constraints=constraints)
        text = str(info.value)
        assert "a scan along a dim that holds the batch's rows, at module <model top level>, op aten.cumsum" in text, \
            text
        assert "test_loss_check_scan.py:" in text and "`locations = torch.cumsum(mask, dim=1) - 1`" in text, text
        assert "keeps the batch whole" in text and "cumsum over the sequence's dim" in text, text
    plan = fairscale.plan(_model(True), batch, devices=2, constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})
    assert plan.mesh.dp == 2


def test_the_search_keeps_a_capacity_routed_batch_whole() -> None:
    plan = fairscale.plan(_model(False), _batch(), devices=2, dtype="fp32")
    assert (plan.mesh.dp, plan.schedule.microbatches) == (1, 1), plan


class SeqFirstShift(nn.Module):
    """A token shift written for a seq-first tensor (``[S, B, D]``): ``torch.roll(h, 1, dims=1)`` rolls
    the batch's dim, so row i takes row i - 1's values; ``op`` "flip" flips it, "seq" rolls the sequence
    (row by row). The loss weighs each row (a sample weight, 0 for the rows a collator masks)."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.inp, self.head, self.op = nn.Linear(DIM, DIM), nn.Linear(DIM, 1), op

    def forward(self, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).transpose(0, 1)                                        # (S, B, D)
        moved = {"roll": lambda: torch.roll(h, 1, dims=1), "flip": lambda: h.flip(1),
                 "seq": lambda: torch.roll(h, 1, dims=0)}[self.op]()
        h = (h + moved).transpose(0, 1)
        return (weight[:, None] * (self.head(h).squeeze(-1) - target) ** 2).mean()


def _weighted_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    weight = torch.ones(8)
    weight[[0, 2]] = 0.0  # the check's window, rows 0-3: a roll over the batch moves values only into rows 0 and 2
    return torch.randn(8, SEQ, DIM, generator=g), torch.randn(8, SEQ, generator=g), weight


@pytest.mark.parametrize("op", ["roll", "flip"])
def test_a_roll_or_flip_along_the_batchs_rows_is_refused_though_the_example_batch_hides_it(op: str) -> None:
    """A fuzzer's model (roll along a seq-first tensor's batch dim, a hinge loss 0 on rows 0 and 2)
    was planned dp2 x 2 microbatches and trained 3.5% off from step 0, silently: the eager check's
    four rows of the example batch gave the batch's loss, since only rows its loss ignores took
    another row's values. Refused for plans that cut the batch, naming the op; the search keeps the
    batch whole; a roll along the sequence plans data parallel."""
    batch = _weighted_batch()
    torch.manual_seed(0)
    if op == "roll":  # the example batch alone would pass it
        assert row_problem(SeqFirstShift(op), batch, None, None, 2) is None
    with pytest.raises(PlanError) as info:
        fairscale.plan(SeqFirstShift(op), batch, devices=2, constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})
    text = str(info.value)
    assert f"aten.{op}.default along a dim that holds the batch's rows" in text and "test_loss_check_scan.py:" in text, \
        text
    assert "keeps the batch whole" in text, text
    assert fairscale.plan(SeqFirstShift(op), batch, devices=2, dtype="fp32").mesh.dp == 1
    plan = fairscale.plan(SeqFirstShift("seq"), batch, devices=2, constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})
    assert plan.mesh.dp == 2
