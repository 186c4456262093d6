"""A loss that divides by a count of the batch's values, in a form the runtime does not weigh, is
refused for plans that cut the batch whatever the example batch counts (``planner.row_counts``).

The eager loss check compares the example batch with its pieces; an unpadded example batch counts
alike in every piece, so ``losses[mask].mean()`` and a masked loss of two terms over one count,
``(l * m).sum() / n + 0.1 * (l * m).pow(2).sum() / n``, passed it and trained under dp2 x 2
microbatches on 2 ranks 0.4% off one process from the first padded batch, silently.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale import PlanError

DP2 = {"mesh": {"pp": 1, "dp": 2, "tp": 1}, "schedule": {"microbatches": 2}}


class MaskedLM(nn.Module):
    def __init__(self, loss: str) -> None:
        super().__init__()
        self.embed, self.head, self.loss = nn.Embedding(11, 8), nn.Linear(8, 11), loss

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        losses = F.cross_entropy(self.head(torch.tanh(self.embed(tokens))).flatten(0, 1), labels.flatten(),
                                 reduction="none")
        m = mask.flatten()
        if self.loss == "selected mean":
            return losses[m > 0].mean()
        n = m.sum()
        if self.loss == "two terms":
            return (losses * m).sum() / n + 0.1 * (losses * m).pow(2).sum() / n
        return (losses * m).sum() / n


def _batch() -> tuple[torch.Tensor, ...]:
    """Unpadded: every piece counts alike."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 11, (8, 6), generator=g), torch.randint(0, 11, (8, 6), generator=g), torch.ones(8, 6)


@pytest.mark.parametrize("loss, found", [
    ("selected mean", "a mean (module <model top level>, op aten.mean.default, source test_loss_check_counts.py:"),
    ("two terms", "a number computed from the whole batch's values (a count of a mask, a sum of lengths), at module "
                  "<model top level>, op aten.sum.default, source test_loss_check_counts.py:"),
])
def test_a_count_of_the_batch_the_runtime_does_not_weigh_is_refused_whatever_the_example_batch_counts(
        loss: str, found: str) -> None:
    torch.manual_seed(0)
    with pytest.raises(PlanError, match=re.escape(found)):
        fairscale.plan(MaskedLM(loss), _batch(), devices=2, constraints=DP2)
    plan = fairscale.plan(MaskedLM(loss), _batch(), devices=2)
    assert (plan.mesh.dp, plan.schedule.microbatches) == (1, 1)  # the search keeps the batch whole
    plan = fairscale.plan(MaskedLM("sum over count"), _batch(), devices=2, constraints=DP2)  # weighed: planned
    assert (plan.mesh.dp, plan.schedule.microbatches) == (2, 2)
