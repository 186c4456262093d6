"""The text report's stage table: each stage's layers and parameters as the passes split them."""

from __future__ import annotations

import torch
from torch import nn

from fairscale.api import captured
from fairscale.report.text import render_report
from planner.plan import Mesh, Plan, Schedule, Stage


class _Block(nn.Module):
    """torchvision's BasicBlock: conv1, bn1, conv2, bn2 (the stem's names), a downsample after them."""

    def __init__(self, downsample: bool = False) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.downsample = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)) if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + (self.downsample(x) if self.downsample is not None else x))


class _ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.layer1, self.layer2 = nn.Sequential(_Block()), nn.Sequential(_Block(downsample=True))
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer2(self.layer1(torch.relu(self.bn1(self.conv1(x))))).mean((2, 3)))


def test_a_layer_a_stage_matches_by_suffix_is_counted_in_the_stage_that_names_it_whole():
    """The search names ResNet's stem "conv1, bn1", which also end layer2.0.conv1 and layer2.0.bn1:
    the report had counted those in both stages, so the stage totals added up to more than the model."""
    model = _ResNet()
    graph = captured(model, (torch.randn(2, 3, 6, 6), torch.tensor([1, 3])), loss_fn=nn.functional.cross_entropy)
    names = [layer.name for layer in graph.layers]
    cut = names.index("layer2.0.conv1")
    plan = Plan(mesh=Mesh(pp=2, dp=1, tp=1), schedule=Schedule(kind="gpipe", microbatches=1, global_batch=2),
                stages=[Stage(layers=", ".join(names[:cut])), Stage(layers=", ".join(names[cut:]))])
    report = render_report(plan, graph)
    totals = [int(line.split()[-1].replace(",", "")) for line in report.splitlines() if line.strip().startswith("total")]
    held = [names[:cut], names[cut:]]
    assert totals == [sum(graph.layer(n).param_count for n in stage) for stage in held], report
    assert sum(totals) == sum(p.numel() for p in model.parameters())
    table = report[report.index("stage  pp rank"):]
    assert "layer2.0" not in table[:table.index("\n    1 ")], report
