"""The loss check on models that draw random numbers in their forward.

HF ``ViTMAEForPreTraining`` (default config) draws its masking noise with ``torch.rand`` in the
forward. Under a plan that cuts the batch (dp4 x 2 microbatches) the loss check's eager runs (the
batch, then each piece) drew other noise each, so their losses differed, and the refusal said "the
loss is not computed row by row ... the loss couples the rows", pointing at ``(loss * mask).sum() /
mask.sum()``, which does not couple them. The check now makes such draws constant
(``fairscale.loss_check_mode.ConstantDraws``), so the model plans data parallel, its ranks drawing
their own noise as they do for dropout; a draw it cannot make constant (``torch.multinomial``) gets a
refusal that names the random op and says to pass the random values in, or to keep the batch whole.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from planner.plan import PlanError

BATCH, PATCHES, DIM, KEEP = 8, 8, 4, 2


class RandomMasking(nn.Module):
    """ViTMAE's random_masking: per row, keep the patches of the smallest noise; the loss is the mean
    reconstruction error over the masked patches (the same count in every row)."""

    def __init__(self, sample: bool = False) -> None:
        super().__init__()
        self.encode, self.decode = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.sample = sample  # the order from torch.multinomial (each row's draws), not from noise

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        if noise is None and not self.sample:
            noise = torch.rand(x.shape[0], PATCHES, device=x.device)
        ids_shuffle = torch.multinomial(torch.ones(x.shape[0], PATCHES), PATCHES) if noise is None else \
            torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        keep = torch.gather(x, 1, ids_shuffle[:, :KEEP, None].expand(-1, -1, DIM))
        latent = self.encode(keep)
        full = torch.cat([latent, latent.new_zeros(x.shape[0], PATCHES - KEEP, DIM)], dim=1)
        pred = self.decode(torch.gather(full, 1, ids_restore[:, :, None].expand(-1, -1, DIM)))
        mask = torch.ones(x.shape[0], PATCHES)
        mask[:, :KEEP] = 0
        mask = torch.gather(mask, 1, ids_restore)
        loss = F.mse_loss(pred, x, reduction="none").mean(-1)
        return (loss * mask).sum() / mask.sum()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, PATCHES, DIM, generator=g), torch.rand(BATCH, PATCHES, generator=g)


def _model(sample: bool = False) -> RandomMasking:
    torch.manual_seed(0)
    return RandomMasking(sample)


def test_a_model_that_draws_its_noise_plans_data_parallel() -> None:
    x, _ = _batch()
    assert fairscale.plan(_model(), (x,), devices=2, constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}}).mesh.dp == 2


def test_a_draw_the_check_cannot_make_constant_is_refused_naming_the_random_op() -> None:
    x, _ = _batch()
    with pytest.raises(PlanError) as err:
        fairscale.plan(_model(sample=True), (x,), devices=2, constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})
    text = str(err.value)
    assert "draws random numbers" in text and "aten.multinomial.default" in text
    assert "test_loss_check_random.py" in text and "torch.multinomial" in text
    assert "Pass the random values in as a batch input" in text
    assert "couples the rows" not in text


def test_the_same_model_given_its_noise_plans_data_parallel() -> None:
    plan = fairscale.plan(_model(), _batch(), devices=2, constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})
    assert plan.mesh.dp == 2


class Mixup(nn.Module):
    """Manifold mixup inside forward: the batch's rows mixed with a shuffle of them (torch.randperm)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(DIM, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        index = torch.randperm(x.size(0))
        logits = self.head(0.7 * h + 0.3 * h[index])
        return 0.7 * F.cross_entropy(logits, y) + 0.3 * F.cross_entropy(logits, y[index])


def test_a_shuffle_of_the_batchs_rows_is_refused_however_the_seed_falls() -> None:
    """Mixup under dp4 x 2 microbatches of an 8-row batch (one row per piece) was accepted and
    trained to other numbers, silently (0.98% off at step 0): the check's seeded randperm(2) was the
    identity, so its two rows mixed nothing. randperm is the reversal in the check now."""
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, DIM), torch.randint(0, 3, (BATCH,))
    for constraints in ({"mesh": {"pp": 1, "dp": 4, "tp": 1}, "schedule": {"microbatches": 2}},
                        {"mesh": {"pp": 1, "dp": 2, "tp": 1}}):
        with pytest.raises(PlanError) as err:
            fairscale.plan(Mixup(), (x, y), devices=constraints["mesh"]["dp"], constraints=constraints)
        assert "aten.randperm.default" in str(err.value) and "torch.randperm" in str(err.value), str(err.value)


class Diffusion(nn.Module):
    """A DDPM training step: a timestep per row from torch.randint, noise from torch.randn_like."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.embed = nn.Linear(DIM, DIM), nn.Embedding(50, DIM)
        self.register_buffer("signal", torch.linspace(1.0, 0.1, 50))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.randint(0, 50, (x.shape[0],), device=x.device).long()
        noise = torch.randn_like(x)
        noisy = self.signal[t][:, None, None] * x + (1 - self.signal[t])[:, None, None] * noise
        return F.mse_loss(self.net(noisy) + self.embed(t)[:, None, :], noise)


def test_a_timestep_drawn_per_row_plans_data_parallel() -> None:
    """A DDPM step under dp4 x 2 microbatches was refused, naming aten.randint.low ('the batch and
    each piece draw other ones'); its rows are drawn independently, as rand's and randn's, which the
    check already made constant. randint now draws its lowest value in the check."""
    x, _ = _batch()
    torch.manual_seed(0)
    plan = fairscale.plan(Diffusion(), (x,), devices=4,
                          constraints={"mesh": {"pp": 1, "dp": 4, "tp": 1}, "schedule": {"microbatches": 2}})
    assert (plan.mesh.dp, plan.schedule.microbatches) == (4, 2)
