"""Models with batch statistics, for the batch-norm tests: written the way their communities write them.

* :class:`ResNet` - torchvision's ``BasicBlock`` style: ``conv3x3(bias=False) → BatchNorm2d →
  ReLU(inplace=True)``, an in-place residual ``out += identity``, a strided block with a 1×1
  conv + BatchNorm2d downsample, global average pooling and a linear head.
* :class:`TabularMLP` - the tabular-data MLP: ``Linear → BatchNorm1d → ReLU`` blocks.

Each ``build_*`` returns a :class:`fairscale.testing.models.Case` (seeded model, batch maker,
cross-entropy loss); ``norm=`` swaps the norm layer (e.g. ``functools.partial(nn.BatchNorm2d,
momentum=None)``) to cover the other forms of the same model.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fairscale.testing.models import Case

__all__ = ["ResNet", "TabularMLP", "build_resnet", "build_tabular", "BATCH_NORM_FAMILIES"]


class BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                 norm: Callable[[int], nn.Module] = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = norm(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """Stem, two basic blocks (the second strided, with a downsample), pooling, a linear head."""

    def __init__(self, classes: int = 10, width: int = 8, norm: Callable[[int], nn.Module] = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = norm(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = BasicBlock(width, width, norm=norm)
        down = nn.Sequential(nn.Conv2d(width, 2 * width, 1, stride=2, bias=False), norm(2 * width))
        self.layer2 = BasicBlock(width, 2 * width, stride=2, downsample=down, norm=norm)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class TabularMLP(nn.Module):
    """``Linear → BatchNorm1d → ReLU`` twice, then a linear head."""

    def __init__(self, features: int = 16, hidden: int = 32, classes: int = 4,
                 norm: Callable[[int], nn.Module] = nn.BatchNorm1d) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Sequential(nn.Linear(features, hidden), norm(hidden), nn.ReLU()),
            nn.Sequential(nn.Linear(hidden, hidden), norm(hidden), nn.ReLU()))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def _classify(shape: tuple[int, ...], classes: int, offset: float) -> Callable[[int, int], tuple[torch.Tensor, ...]]:
    def make(step: int, batch: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(3000 + step)
        # an offset mean, so batch statistics are far from the initial running statistics
        return (torch.randn((batch, *shape), generator=g) + offset,
                torch.randint(0, classes, (batch,), generator=g))

    return make


def build_resnet(seed: int = 0, *, norm: Callable[[int], nn.Module] = nn.BatchNorm2d) -> Case:
    torch.manual_seed(seed)
    return Case("resnet", ResNet(norm=norm), _classify((3, 8, 8), 10, 0.5), F.cross_entropy)


def build_tabular(seed: int = 0, *, norm: Callable[[int], nn.Module] = nn.BatchNorm1d) -> Case:
    torch.manual_seed(seed)
    return Case("tabular", TabularMLP(norm=norm), _classify((16,), 4, 2.0), F.cross_entropy)


BATCH_NORM_FAMILIES: dict[str, Callable[..., Case]] = {"resnet": build_resnet, "tabular": build_tabular}
