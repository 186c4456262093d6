"""A tp the detector found no rules for is refused with the module and what to do.

HF ``ResNetForImageClassification`` (default config, 3 labels) under a forced pp2 x tp2: its only
Linear is the 3-way classifier, which tp=2 cannot split, so the detector proposed nothing and the
refusal said why ("inner.classifier.1: cannot shard ... dim 0 has size 3") but neither that it
was a module nor what to do; the corpus marks such a refusal as lacking both. It now reads
"module inner.classifier.1: ..." and ends with the remedy (tp=1, or rules for modules it can split).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fairscale
from fairscale.testing.corpus_run import refusal_gaps
from planner.plan import PlanError


class ConvClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.classifier(self.features(x)), y)


def test_no_rules_at_a_tp_names_the_module_and_what_to_do() -> None:
    torch.manual_seed(0)
    batch = (torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,)))
    with pytest.raises(PlanError) as info:
        fairscale.plan(ConvClassifier(), batch, devices=2, constraints={"mesh": {"pp": 1, "dp": 1, "tp": 2}})
    message = str(info.value)
    assert "no tensor-parallel rules at tp=2: module classifier: " in message, message
    assert "Use tp=1 (leave mesh.tp out of the constraints)" in message, message
    assert refusal_gaps(message) == [], (refusal_gaps(message), message)
