"""Factories for tests/test_cli.py, imported by the CLI as ``cli_factories:NAME``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fairscale.testing.models import Case, MLPNet, build

NOT_A_FUNCTION = 3


def gpt() -> Case:
    """A tiny nanoGPT-style model: 2 blocks, width 32, 2 heads."""
    return build("gpt", layers=2, dim=32, heads=2, seq=8, vocab=64)


def mlp_with_loss_fn() -> tuple[nn.Module, tuple[torch.Tensor, ...], object]:
    torch.manual_seed(0)
    return MLPNet(), (torch.randn(4, 32), torch.randint(0, 10, (4,))), F.cross_entropy


class _SelfLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLPNet()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)


def self_loss() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return _SelfLoss(), (torch.randn(4, 32), torch.randint(0, 10, (4,)))


def self_loss_by_name() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The batch as a Hugging Face collator hands it: a dict of the forward's inputs by name."""
    torch.manual_seed(0)
    return _SelfLoss(), {"y": torch.randint(0, 10, (4,)), "x": torch.randn(4, 32)}


def module_only() -> nn.Module:
    return nn.Linear(2, 2)


def broken() -> Case:
    raise RuntimeError("no weights here")


def wrong_type() -> int:
    return 42
