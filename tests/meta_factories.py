"""A factory of a model on ``meta`` for ``fairscale plan`` (``meta_factories:gpt_meta``), used by
tests/test_compile_check_memo.py."""

from __future__ import annotations

import torch
from torch import nn


def gpt_meta() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """A small GPT on ``meta`` (planned, never run): 4 blocks, width 64, 4 heads, sequence 16."""
    from fairscale.testing.models import GPT, GPTConfig, lm_loss

    with torch.device("meta"):
        model = GPT(GPTConfig(layers=4, dim=64, heads=4, seq=16, vocab=128))
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    return model, (ids, ids), lm_loss
