"""A router's load-balancing loss couples the batch's rows with a small weight, and is refused.

Hugging Face's MoE decoders called with ``output_router_logits=True`` (OLMoE, GraniteMoE, Mixtral,
Jamba: default configs, ``router_aux_loss_coef=0.001``) add ``coef * load_balancing_loss``, a
product of two means over every token of the batch, to the cross entropy. Under every plan that
cuts the batch (the searched dp4, pp2 x tp2 in 2 microbatches, dp4 x 2 microbatches, dp2 x 2
microbatches) they trained to other numbers, silently: OLMoE's gradients 1.4% off, Mixtral's 0.16%.
The loss check compared the losses (off by 3e-6 to 3e-5, under its tolerance of 1e-3) and one
gradient projection over all the parameters together (the routers' share of it too small to
pass 1e-3). It compares each parameter tensor's gradient too now, against its own norm, at 1e-4
in float32 (rounding stays under 1e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.loss_check import row_problem
from passes.loss_weights import token_counter
from planner.capture import capture
from planner.plan import PlanError


class AuxMoE(nn.Module):
    """Top-2 of 4 experts with Switch/HF's load-balancing loss, weighed 0.001, beside the cross entropy."""

    def __init__(self, coef: float = 0.001) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.router = nn.Linear(16, 4, bias=False)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 32)
        self.coef = coef

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        probs = self.router(h).softmax(-1)
        weight, chosen = probs.topk(2, dim=-1)
        mask = F.one_hot(chosen, 4).float()
        out = h + sum((weight.unsqueeze(-1) * mask[..., e:e + 1]).sum(-2) * expert(h)
                      for e, expert in enumerate(self.experts))
        ce = F.cross_entropy(self.head(out).flatten(0, 1), labels.flatten())
        aux = 4 * (mask.flatten(0, 1).mean(0) * probs.flatten(0, 1).mean(0).unsqueeze(0)).sum()
        return ce + self.coef * aux


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 32, (8, 6), generator=g), torch.randint(0, 32, (8, 6), generator=g)


def test_a_load_balancing_loss_is_found_by_the_routers_gradient() -> None:
    torch.manual_seed(0)
    batch = _batch()
    model = AuxMoE()
    gm = capture(model, batch, annotate=False).gm
    found = row_problem(model, batch, None, token_counter(gm), 2, gm=gm)
    assert found is not None and "the loss is not computed row by row" in found and "gradients differ by" in found \
        and "load-balancing loss" in found, found
    model.coef = 0.0  # the same experts without the term: row by row
    assert row_problem(model, batch, None, token_counter(gm), 2, gm=gm) is None


def test_a_plan_that_cuts_the_batch_is_refused_naming_the_check() -> None:
    torch.manual_seed(0)
    with pytest.raises(PlanError) as info:
        fairscale.plan(AuxMoE(), _batch(), devices=2, constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})
    assert "the loss is not computed row by row" in str(info.value), str(info.value)
