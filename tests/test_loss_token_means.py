"""A constant combination of token means over the same labels is one token mean, reweighted exactly.

torchvision's segmentation recipe (references/segmentation/train.py) trains DeepLabV3 and FCN with
``ce(out, target, ignore_index=255) + 0.5 * ce(aux, target, ignore_index=255)``, the void label
255 on object borders, so the images of a batch count different numbers of pixels. Every plan that
cuts the batch was refused ("the loss is a token mean ... combined with other terms ... count
different numbers of labels ... [(1466, 1466), (1517, 1517), ...]"), and the search kept the batch
whole (pp4 on 4 ranks). Both terms divide by the same count, so the loss is
``(S_out + 0.5 S_aux) / n``: one token mean, which the pieces reweigh by their counts exactly.
"""

from __future__ import annotations

import functools
import re
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.testing.models import Case
from fairscale.testing.reference import RankResult, compare_grads, rank_trajectory, train_on_rank, train_reference
from passes.loss_count import piece_weights
from passes.loss_weights import token_counter
from planner.capture import capture

CONSTRAINTS = {"mesh": {"pp": 1, "dp": 2, "tp": 1}, "schedule": {"microbatches": 2}}


class Segmenter(nn.Module):
    """torchvision's _SimpleSegmentationModel: a backbone's two feature maps, two heads, upsampled."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Conv2d(8, 8, 3, 2, 1), nn.ReLU())
        self.classifier = nn.Conv2d(8, 4, 1)
        self.aux_classifier = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        aux = self.layer1(x)
        out = self.layer2(aux)
        result = OrderedDict()
        result["out"] = F.interpolate(self.classifier(out), size=x.shape[-2:], mode="bilinear", align_corners=False)
        result["aux"] = F.interpolate(self.aux_classifier(aux), size=x.shape[-2:], mode="bilinear",
                                      align_corners=False)
        return result


def criterion(inputs: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    losses = {name: F.cross_entropy(x, target, ignore_index=255) for name, x in inputs.items()}
    return losses["out"] + 0.5 * losses["aux"]


def product(inputs: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(inputs["out"], target, ignore_index=255) * F.cross_entropy(inputs["aux"], target,
                                                                                         ignore_index=255)


def other_labels(inputs: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    coarse = torch.where(target == 255, target, target // 2)
    return F.cross_entropy(inputs["out"], target, ignore_index=255) + F.cross_entropy(inputs["aux"], coarse,
                                                                                        ignore_index=255)


def _batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    target = torch.randint(0, 4, (rows, 8, 8), generator=g)
    for i in range(rows):  # void borders of another width in each image
        target[i, : i % 3 + 1] = 255
    return torch.randn(rows, 3, 8, 8, generator=g), target


def _case() -> Case:
    torch.manual_seed(0)
    return Case("segmenter", Segmenter(), _batch, criterion)


def test_a_constant_combination_of_token_means_over_the_same_labels_is_one_token_mean() -> None:
    torch.manual_seed(0)
    counter = token_counter(capture(Segmenter(), _batch(0), loss_fn=criterion, annotate=False).gm)
    assert counter is not None and counter.kind == "mean" and counter.exact
    assert counter(_batch(0)) == int((_batch(0)[1] != 255).sum())
    for loss_fn in (product, other_labels):  # not a token mean: the pieces must count alike
        counter = token_counter(capture(Segmenter(), _batch(0), loss_fn=loss_fn, annotate=False).gm)
        assert counter is not None and not counter.exact, loss_fn.__name__
    plan = fairscale.plan(Segmenter(), _batch(0), devices=2, loss_fn=criterion, constraints=CONSTRAINTS)
    assert (plan.mesh.dp, plan.schedule.microbatches) == (2, 2)


def _train(rank: int, world: int) -> RankResult:
    return train_on_rank(_case(), constraints=CONSTRAINTS, optimizer=functools.partial(torch.optim.SGD, lr=0.1))


def test_segmentation_with_an_aux_loss_trains_as_one_process_under_dp2_and_2_microbatches() -> None:
    reference = train_reference(_case, steps=3, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    compare_grads(reference, rank_trajectory(fairscale.launch(_train, devices=2)[0]))


class MaskedLM(nn.Module):
    """Megatron's loss: per-token cross entropy times the batch's loss mask, summed, over the mask's sum."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(tokens)))
        losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        return (losses * loss_mask.flatten()).sum() / loss_mask.sum()


def _lm_batch(step: int, rows: int = 8) -> tuple[torch.Tensor, ...]:
    """The example batch (step 0) is unpadded, so every piece counts alike; later ones are padded."""
    g = torch.Generator().manual_seed(step)
    tokens, labels = torch.randint(0, 11, (rows, 6), generator=g), torch.randint(0, 11, (rows, 6), generator=g)
    lengths = torch.full((rows,), 6) if step == 0 else torch.randint(1, 7, (rows,), generator=g)
    return tokens, labels, (torch.arange(6) < lengths[:, None]).float()


def _lm_case() -> Case:
    torch.manual_seed(0)
    return Case("masked-lm", MaskedLM(), _lm_batch, None)


def test_a_sum_over_a_count_the_batch_gives_is_weighed_by_the_pieces_counts() -> None:
    counter = token_counter(capture(_lm_case().model, _lm_batch(0), annotate=False).gm)
    assert counter is not None and counter.kind == "mean" and counter.exact and counter.divides
    assert counter.count_all([_lm_batch(1), _lm_batch(0)]) == [float(_lm_batch(1)[2].sum()), 48.0]
    assert piece_weights(counter, [[4.0, 12.0]], 0) == [0.25, 0.75]  # n / N each (dp 1)
    # a piece whose mask is all zeros computes 0 / 0: the step is refused, where its gradient was nan
    with pytest.raises(ValueError, match=re.escape("counts nothing ([0.0, 5.0, 12.0, 9.0]): its loss is 0 / 0")):
        piece_weights(counter, [[0.0, 5.0], [12.0, 9.0]], 0)


def _train_lm(rank: int, world: int) -> RankResult:
    return train_on_rank(_lm_case(), constraints=CONSTRAINTS, optimizer=functools.partial(torch.optim.SGD, lr=0.1))


def test_a_loss_over_the_batchs_mask_count_trains_as_one_process_under_dp2_and_2_microbatches() -> None:
    reference = train_reference(_lm_case, steps=3, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    compare_grads(reference, rank_trajectory(fairscale.launch(_train_lm, devices=2)[0]))


class ClampedMaskedLM(MaskedLM):
    """The same loss as written against an all-padding piece, halved: ``0.5 * (l * m).sum() / m.sum().clamp(min=1)``."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(tokens)))
        losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        return 0.5 * ((losses * loss_mask.flatten()).sum() / loss_mask.sum().clamp(min=1))


def _padded_batch(step: int, rows: int = 8) -> tuple[torch.Tensor, ...]:
    """:func:`_lm_batch`, with the first two rows all padding from step 2 (a piece that counts nothing)."""
    tokens, labels, mask = _lm_batch(step, rows)
    if step >= 2:
        mask[:2] = 0
    return tokens, labels, mask


SPELLINGS = {
    "clamp": lambda s, m: s / m.sum().clamp(min=1),
    "eps": lambda s, m: s / (m.sum() + 1e-8),
    "max": lambda s, m: s / torch.max(m.sum(), torch.ones(())),
    "reciprocal": lambda s, m: s * m.sum().reciprocal(),
    "scaled": lambda s, m: 0.5 * (s / m.sum()),
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_a_sum_over_a_function_of_the_batchs_count_is_weighed_by_the_pieces_divisors(spelling: str) -> None:
    """Spelled otherwise than ``sum / count`` (clamped, plus an epsilon, times its reciprocal, halved),
    the loss was taken for a mean over rows and its pieces averaged plainly: dp2 x 2 microbatches of
    the masked LM trained 0.4% off at step 1 and 25% off at step 2 (a piece that counts nothing)."""
    class Spelled(MaskedLM):
        def forward(self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
            logits = self.head(torch.tanh(self.embed(tokens)))
            losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
            return SPELLINGS[spelling]((losses * loss_mask.flatten()).sum(), loss_mask)

    counter = token_counter(capture(Spelled(), _lm_batch(0), annotate=False).gm)
    assert counter is not None and counter.kind == "mean" and counter.exact and counter.divides
    assert counter.count_all([_lm_batch(1), _lm_batch(0)]) == [float(_lm_batch(1)[2].sum()), 48.0]
    if spelling == "scaled":  # the count itself: n / N
        assert counter.divisor is None and piece_weights(counter, [[4.0, 12.0]], 0) == [0.25, 0.75]
    elif spelling in ("clamp", "max"):  # d(n) = max(n, 1): a piece that counts nothing weighs 1 / N
        assert piece_weights(counter, [[0.0, 5.0], [12.0, 9.0]], 1) == [2 * 12 / 26, 2 * 9 / 26]
        assert piece_weights(counter, [[0.0, 5.0], [12.0, 9.0]], 0) == [2 * 1 / 26, 2 * 5 / 26]
    elif spelling == "reciprocal":  # times 1 / 0: refused, as sum / count is
        with pytest.raises(ValueError, match=re.escape("divides by 0.0 (counts [0.0, 5.0, 12.0, 9.0])")):
            piece_weights(counter, [[0.0, 5.0], [12.0, 9.0]], 0)


def _clamped_case() -> Case:
    torch.manual_seed(0)
    return Case("clamped-masked-lm", ClampedMaskedLM(), _padded_batch, None)


def _train_clamped(rank: int, world: int) -> RankResult:
    return train_on_rank(_clamped_case(), constraints=CONSTRAINTS,
                         optimizer=functools.partial(torch.optim.SGD, lr=0.1))


def test_a_clamped_count_trains_as_one_process_under_dp2_and_2_microbatches_with_a_piece_that_counts_nothing() -> None:
    reference = train_reference(_clamped_case, steps=3, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    compare_grads(reference, rank_trajectory(fairscale.launch(_train_clamped, devices=2)[0]))
