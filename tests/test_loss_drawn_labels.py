"""A token mean over labels the forward draws is refused for plans that cut the batch.

lucidrains' MaskGIT (muse-maskgit-pytorch) draws each row's masking ratio from a cosine schedule in
its forward, masks that many tokens, and takes ``cross_entropy(logits, where(mask, ids, -1),
ignore_index=-1)``: a mean over the masked tokens of the whole batch. Under dp2 each rank took the
mean over its own masked tokens and the runtime averaged the two, so a rank that masked 4 tokens
weighed as much as one that masked 64: with the same draws as one process (fed to each rank's rows),
the loss was 4.311 where one process computes 3.916 and gradients 2.3x their norm off, silently.
The loss check's constant draws mask every row alike, so the pieces matched there. No piece's
count is known before its forward has drawn it, so the pieces cannot be weighed:
``passes.loss_weights.token_counter`` returns a counter of kind ``uncounted``, and the plan is
refused, naming the draw and the loss with their lines.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.capture_cache import rank_capture
from passes.loss_weights import token_counter
from planner.search import NoCompilablePlan

V, L = 16, 8


class MaskGit(nn.Module):
    def __init__(self, teacher: bool = False) -> None:
        super().__init__()
        self.teacher = teacher
        self.emb = nn.Embedding(V + 1, 16)
        self.to_logits = nn.Linear(16, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, seq_len = ids.shape
        if self.teacher:  # hard labels from the model itself: every token counts in every piece
            labels = self.to_logits(self.emb(ids)).detach().argmax(-1)
            return F.cross_entropy(self.to_logits(self.emb(ids)).transpose(1, 2), labels)
        rand_time = torch.zeros((batch,)).uniform_(0, 1)
        num_token_masked = (seq_len * torch.cos(rand_time * math.pi * 0.5)).round().clamp(min=1)
        mask = torch.rand((batch, seq_len)).argsort(dim=-1) < num_token_masked.unsqueeze(-1)
        labels = torch.where(mask, ids, -1)
        logits = self.to_logits(self.emb(torch.where(mask, V, ids)))
        return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-1)


def _batch() -> tuple[torch.Tensor]:
    return (torch.randint(0, V, (8, L), generator=torch.Generator().manual_seed(0)),)


def test_labels_drawn_in_forward_are_not_countable() -> None:
    counter = token_counter(rank_capture(MaskGit(), _batch()).gm)
    assert counter is not None and counter.kind == "uncounted" and not counter.exact
    assert "a random draw (op aten.uniform_.default, source test_loss_drawn_labels.py:" in counter.why
    # labels that never hold ignore_index (a teacher's argmax) keep the plain mean
    assert token_counter(rank_capture(MaskGit(teacher=True), _batch()).gm) is None


@pytest.mark.parametrize("constraints", [{"mesh": {"dp": 2}}, {"mesh": {"dp": 1}, "schedule": {"microbatches": 2}}],
                         ids=["dp2", "2-microbatches"])
def test_a_token_mean_over_drawn_labels_is_refused_for_plans_that_cut_the_batch(constraints: dict) -> None:
    torch.manual_seed(0)
    model = MaskGit()
    with pytest.raises(NoCompilablePlan) as e:
        fairscale.plan(model, _batch(), devices=2, constraints=constraints)
    text = str(e.value)
    assert "over labels computed in the forward from a random draw (op aten.uniform_.default" in text
    assert "pass the labels with the batch" in text
    assert "The loss is computed at module <model top level>, op aten.cross_entropy_loss.default, " \
           "source test_loss_drawn_labels.py:" in text
    plan = fairscale.plan(model, _batch(), devices=2, constraints={"mesh": {"pp": 2}})  # the batch kept whole
    assert plan.mesh.dp == 1 and plan.schedule.microbatches == 1
