"""GShard top-2 gating (Lepikhin et al. 2020, "GShard", Algorithm 1), FairScale 0.4.13's ``Top2Gate``.

For ``S`` tokens and ``E`` experts with capacity ``C = 2·⌈S/E⌉`` slots per expert (FairScale
requires ``S`` divisible by ``E``; then ``C = 2S/E`` exactly)::

    gates = softmax(x · W_g)                      (S, E), in fp32
    e1 = argmax gates;  e2 = argmax (logits + Gumbel noise) without e1    (GShard's random routing)
    slot of a token at e1 = its rank among tokens choosing e1 first; at e2, after all e1 tokens
    tokens beyond C slots are dropped for that expert
    g1, g2 = gates at e1, e2, renormalized so g1 + g2 = 1
    l_aux = mean_e( mean_s(gates[:, e]) · mean_s(onehot(e1)[:, e]) )       (load-balancing loss)

returning ``combine_weights`` (S, E, C) and the boolean ``dispatch_mask`` (S, E, C), in the
logits' dtype. ``l_aux`` is FairScale 0.4.13's: the mean over experts of the product of each
expert's mean gate and its share of first choices (GShard's ``E² ·`` that value, divided by ``E²``;
with uniform routing it is ``1/E²``). The Gumbel noise is drawn from
``torch.distributions.Gumbel(0, 1)``, as FairScale does, so one seed gives the same routing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Top2Gate", "top2gating"]


def _gumbel(shape: torch.Size, device: torch.device) -> torch.Tensor:
    zero, one = torch.zeros((), device=device), torch.ones((), device=device)
    return torch.distributions.Gumbel(zero, one).rsample(shape)


def top2gating(logits: torch.Tensor, *, second_expert_noise: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(l_aux, combine_weights, dispatch_mask)`` for ``logits`` of shape (tokens, experts)."""
    gates = F.softmax(logits, dim=1, dtype=torch.float32)
    num_tokens, num_experts = gates.shape
    capacity = 2 * math.ceil(num_tokens / num_experts)
    idx1 = gates.argmax(dim=1)
    mask1 = F.one_hot(idx1, num_experts)
    scores2 = logits + _gumbel(logits.shape, logits.device) if second_expert_noise else logits
    idx2 = scores2.masked_fill(mask1.bool(), float("-inf")).argmax(dim=1)
    mask2 = F.one_hot(idx2, num_experts)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = (me * ce).mean()
    mask1 = mask1 * (loc1 < capacity)
    mask2 = mask2 * (loc2 < capacity)
    slot1 = (loc1 * mask1).sum(dim=1)
    slot2 = (loc2 * mask2).sum(dim=1)
    g1 = (gates * mask1).sum(dim=1)
    g2 = (gates * mask2).sum(dim=1)
    denom = (g1 + g2).clamp(min=torch.finfo(gates.dtype).eps)
    g1, g2 = g1 / denom, g2 / denom
    slot1_1h = F.one_hot(slot1, capacity).to(gates.dtype)
    slot2_1h = F.one_hot(slot2, capacity).to(gates.dtype)
    combine = (g1[:, None, None] * mask1.to(gates.dtype)[:, :, None] * slot1_1h[:, None, :]
               + g2[:, None, None] * mask2.to(gates.dtype)[:, :, None] * slot2_1h[:, None, :])
    return l_aux.to(logits.dtype), combine.to(logits.dtype), combine.bool()


class Top2Gate(nn.Module):
    """Top-2 gate: a bias-free linear router followed by :func:`top2gating`.

    Args:
        model_dim: token feature size.
        num_experts: total experts over all ranks.
        second_expert_noise: choose the second expert on Gumbel-perturbed logits, as FairScale
            does (GShard's random routing) in training and in eval mode alike; ``False`` takes the
            plain second-best expert, which is deterministic (keyword-only; not in FairScale).
    """

    def __init__(self, model_dim: int, num_experts: int, *, second_expert_noise: bool = True) -> None:
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.second_expert_noise = second_expert_noise

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return top2gating(self.wg(x), second_expert_noise=self.second_expert_noise)
