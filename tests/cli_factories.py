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


def module_only() -> nn.Module:
    return nn.Linear(2, 2)


def broken() -> Case:
    raise RuntimeError("no weights here")


def wrong_type() -> int:
    return 42


class _SkipBlock(nn.Module):
    """A residual written in place, ResNet style: ``r += h``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, dim)
        self.skip = nn.Linear(dim, dim)
        self.down = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        r = self.skip(x)
        r += h
        return self.down(torch.relu(r))


class InplaceResidual(nn.Module):
    def __init__(self, dim: int = 16, layers: int = 4, classes: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_SkipBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.head(x)


def inplace_residual() -> tuple[nn.Module, tuple[torch.Tensor, ...], object]:
    """A model whose in-place residual add the tensor-parallel pass refuses when only ``up`` is
    column-parallel (the replicated ``r`` would have to become a shard in place)."""
    torch.manual_seed(0)
    return InplaceResidual(), (torch.randn(8, 16), torch.randint(0, 4, (8,))), F.cross_entropy
