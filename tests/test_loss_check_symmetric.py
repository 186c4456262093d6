"""CLIP's symmetric contrastive loss is refused for plans that cut the batch (fairscale.loss_check).

Hugging Face ``CLIPModel(..., return_loss=True)`` averages two cross entropies over the in-batch
similarity matrix, each against ``arange(rows)``. The loss check skipped every loss with several
token means ("no rule to check against"), so with its default config the searched plan on 4
ranks (dp4), a forced pp2 x tp2 (2 microbatches) and dp4 x 2 microbatches all trained silently to
other numbers (first loss 1.25 against 2.99 under dp4: each piece saw only its own rows as
negatives). Token means that count alike in every piece are averaged by the runtime, so the
check now compares the batch's loss with that average, and refuses.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.loss_check import row_problem
from fairscale.testing.corpus_run import refusal_gaps
from passes.loss_weights import token_counter
from planner.capture import capture
from planner.plan import PlanError


class Symmetric(nn.Module):
    """CLIP's loss: the mean of the text-to-image and image-to-text cross entropies."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = F.normalize(self.a(x), dim=-1) @ F.normalize(self.b(y), dim=-1).t() / 0.1
        target = torch.arange(x.shape[0])
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2


def _batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def test_two_token_means_over_the_in_batch_pairs_are_checked_and_refused() -> None:
    torch.manual_seed(0)
    model, batch = Symmetric(), _batch()
    problem = row_problem(model, batch, None, token_counter(capture(model, batch, annotate=False).gm), 2)
    assert problem is not None and "not computed row by row" in problem, problem
    assert "the mean of the pieces' losses" in problem, problem
    for constraints in ({"mesh": {"dp": 2}}, {"mesh": {"pp": 2}, "schedule": {"microbatches": 2}}):
        with pytest.raises(PlanError, match="not computed row by row"):
            fairscale.plan(model, batch, devices=2, constraints=constraints)


def _clip() -> nn.Module:
    transformers = pytest.importorskip("transformers")

    text = transformers.CLIPTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, max_position_embeddings=8, pad_token_id=63,
                                       bos_token_id=62, eos_token_id=61)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=8, patch_size=4)
    return transformers.CLIPModel(transformers.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                                          projection_dim=16))


class Clip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _clip()

    def forward(self, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, pixel_values=pixels, return_loss=True).loss


def test_hf_clip_default_config_is_refused_where_the_plan_cuts_the_batch() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model, batch = Clip(), (torch.randint(0, 61, (8, 8), generator=g), torch.randn(8, 3, 8, 8, generator=g))
    with pytest.raises(PlanError, match="not computed row by row") as info:
        fairscale.plan(model, batch, devices=4, constraints={"mesh": {"pp": 1, "dp": 4, "tp": 1}})
    message = str(info.value)  # where: the loss op and its line in the model's source
    assert "op aten.cross_entropy_loss.default, source modeling_clip.py:" in message, message
    assert refusal_gaps(message) == [], (refusal_gaps(message), message)
    plan = fairscale.plan(model, batch, devices=4, constraints={"mesh": {"pp": 2, "dp": 1, "tp": 2}})
    assert plan.schedule.microbatches == 1, plan.schedule


def _searched(rank: int, world: int) -> tuple[tuple[int, int], list[float]]:
    torch.manual_seed(0)
    pm = fairscale.parallelize(Symmetric(), example_inputs=_batch(), optimizer=functools.partial(torch.optim.SGD, lr=0.5))
    return (pm.plan.mesh.dp, pm.plan.schedule.microbatches), [pm.train_step(_batch(s)) for s in range(3)]


def test_parallelize_trains_the_symmetric_loss_exactly() -> None:
    (cut, losses), _ = fairscale.launch(_searched, devices=2)
    assert cut == (1, 1), cut
    torch.manual_seed(0)
    model = Symmetric()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = []
    for s in range(3):
        opt.zero_grad()
        loss = model(*_batch(s))
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-5)
