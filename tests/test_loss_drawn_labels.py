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
    def __init__(self, teacher: bool = False, by_hand: bool = False, fixed: bool = False) -> None:
        super().__init__()
        self.teacher, self.by_hand, self.fixed = teacher, by_hand, fixed
        self.emb = nn.Embedding(V + 1, 16)
        self.to_logits = nn.Linear(16, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, seq_len = ids.shape
        if self.teacher:  # hard labels from the model itself: every token counts in every piece
            labels = self.to_logits(self.emb(ids)).detach().argmax(-1)
            return F.cross_entropy(self.to_logits(self.emb(ids)).transpose(1, 2), labels)
        rand_time = torch.zeros((batch,)).uniform_(0, 1)
        num_token_masked = (seq_len * torch.cos(rand_time * math.pi * 0.5)).round().clamp(min=1)
        if self.fixed:  # BERT's share, the same number of tokens in every row: every piece keeps as many
            num_token_masked = torch.full((batch,), 3.0)
        mask = torch.rand((batch, seq_len)).argsort(dim=-1) < num_token_masked.unsqueeze(-1)
        labels = torch.where(mask, ids, -1)
        logits = self.to_logits(self.emb(torch.where(mask, V, ids)))
        if self.by_hand:  # the masked mean written out: the same loss, a sum over a count the draw gives
            ce = F.cross_entropy(logits.transpose(1, 2), ids, reduction="none")
            return (ce * mask.float()).sum() / mask.float().sum()
        return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-1)


def _batch() -> tuple[torch.Tensor]:
    return (torch.randint(0, V, (8, L), generator=torch.Generator().manual_seed(0)),)


def test_labels_drawn_in_forward_are_not_countable() -> None:
    counter = token_counter(rank_capture(MaskGit(), _batch()).gm)
    assert counter is not None and counter.kind == "uncounted" and not counter.exact
    assert "a random draw (op aten.uniform_.default, source test_loss_drawn_labels.py:" in counter.why
    # labels that never hold ignore_index (a teacher's argmax) keep the plain mean
    assert token_counter(rank_capture(MaskGit(teacher=True), _batch()).gm) is None
    by_hand = token_counter(rank_capture(MaskGit(by_hand=True), _batch()).gm)
    assert by_hand is not None and by_hand.kind == "uncounted" and "aten.uniform_.default" in by_hand.why


@pytest.mark.parametrize("by_hand", [False, True], ids=["ignore_index", "masked-mean"])
def test_a_drawn_mask_of_a_fixed_count_per_row_plans_dp(by_hand: bool) -> None:
    """ViTMAE's and BERT's masks keep as many positions in every row whatever the draw: the plain mean
    of the pieces is the batch's mean, and dp2 plans."""
    torch.manual_seed(0)
    model = MaskGit(by_hand=by_hand, fixed=True)
    assert token_counter(rank_capture(model, _batch()).gm) is None
    assert fairscale.plan(model, _batch(), devices=2, constraints={"mesh": {"dp": 2}}).mesh.dp == 2


def test_a_masked_mean_over_a_drawn_mask_is_refused_for_dp() -> None:
    """The same MaskGIT with its loss written (ce * mask).sum() / mask.sum() was planned dp2 too."""
    torch.manual_seed(0)
    with pytest.raises(NoCompilablePlan, match=r"the loss is a mean \(a sum over its count\) over the labels or "
                                               r"positions its forward keeps, which it computes from a random draw"):
        fairscale.plan(MaskGit(by_hand=True), _batch(), devices=2, constraints={"mesh": {"dp": 2}})


@pytest.mark.parametrize("constraints", [{"mesh": {"dp": 2}}, {"mesh": {"dp": 1}, "schedule": {"microbatches": 2}}],
                         ids=["dp2", "2-microbatches"])
def test_a_token_mean_over_drawn_labels_is_refused_for_plans_that_cut_the_batch(constraints: dict) -> None:
    torch.manual_seed(0)
    model = MaskGit()
    with pytest.raises(NoCompilablePlan) as e:
        fairscale.plan(model, _batch(), devices=2, constraints=constraints)
    text = str(e.value)
    assert "the loss is a mean (aten.cross_entropy_loss.default) over the labels or positions its forward keeps, " \
           "which it computes from a random draw (op aten.uniform_.default" in text
    assert "pass the labels with the batch" in text
    assert "The loss is computed at module <model top level>, op aten.cross_entropy_loss.default, " \
           "source test_loss_drawn_labels.py:" in text
    plan = fairscale.plan(model, _batch(), devices=2, constraints={"mesh": {"pp": 2}})  # the batch kept whole
    assert plan.mesh.dp == 1 and plan.schedule.microbatches == 1
