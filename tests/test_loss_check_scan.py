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
