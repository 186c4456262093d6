"""Model factories for timing ``fairscale plan`` (``benchmarks/planner/speed.py --cli``): Megatron
GPT shapes on the meta device, so no weights are allocated."""

from __future__ import annotations

import torch

from fairscale.testing.models import GPT, GPTConfig, lm_loss


def gpt_1t() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """GPT 1T (Narayanan et al. 2021, Table 1: 128 layers, width 25600, 160 heads), sequence 2048."""
    with torch.device("meta"):
        model = GPT(GPTConfig(layers=128, dim=25600, heads=160, seq=2048, vocab=51200))
    ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    return model, (ids, ids), lm_loss
