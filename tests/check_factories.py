"""Factories for the compile-check and check tests, imported by the CLI as ``check_factories:NAME``
(kept apart from cli_factories, whose list of callables test_cli asserts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _SkipBlock(nn.Module):
    """A residual written in place, ResNet style, on a view: ``r += h`` where ``r`` is a reshape
    of the skip branch (a mutation of a view cannot be rewritten out of place: the TP pass refuses
    it when ``r`` and ``h`` are laid out differently)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, dim)
        self.skip = nn.Linear(dim, dim)
        self.down = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        r = self.skip(x).view(x.shape)
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
