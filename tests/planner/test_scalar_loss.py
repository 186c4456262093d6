"""A loss that is not one number is refused at capture, naming what to do, instead of being summed
(the sum, and so the gradients, would depend on the plan: issue 'Real models', item 3)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from planner.capture import CaptureError, capture


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(8, 8), torch.randint(0, 4, (8,))


def per_sample(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("tracer", ["export", "fx"])
def test_a_per_sample_loss_is_refused(tracer: str) -> None:
    with pytest.raises(CaptureError, match=r"loss_fn \(per_sample\) returned a tensor of shape \(8,\), not a "
                                           r"scalar loss. Reduce it in loss_fn \(reduction='mean'"):
        capture(Net(), _batch(), loss_fn=per_sample, tracer=tracer)


def test_logits_without_a_loss_fn_are_refused_through_the_public_api() -> None:
    x, _ = _batch()
    with pytest.raises(CaptureError, match=r"Net returned a tensor of shape \(8, 4\), not a scalar loss \(logits\?\). "
                                           r"Pass loss_fn="):
        fairscale.plan(Net(), (x,), devices=2)


def test_a_reduced_loss_and_a_one_element_loss_are_accepted() -> None:
    assert capture(Net(), _batch(), loss_fn=F.cross_entropy).num_parameters > 0
    capture(Net(), _batch(), loss_fn=lambda out, y: F.cross_entropy(out, y).reshape(1))


class LogitsAndLoss(nn.Module):
    """nanoGPT's convention: forward(x, targets) returns (logits, loss)."""

    def __init__(self, second_scalar: bool = False) -> None:
        super().__init__()
        self.net = Net()
        self.second_scalar = second_scalar

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        return (logits, loss, logits.mean()) if self.second_scalar else (logits, loss)


@pytest.mark.parametrize("tracer", ["export", "fx"])
def test_a_logits_and_loss_tuple_trains_on_its_one_scalar(tracer: str) -> None:
    model, batch = LogitsAndLoss(), _batch()
    graph = capture(model, batch, tracer=tracer)
    assert graph.gm(*batch).item() == pytest.approx(model(*batch)[1].item(), rel=1e-6)


def test_a_tuple_with_two_scalars_is_refused_naming_them() -> None:
    with pytest.raises(CaptureError, match=r"returned a tuple \(\[0\]: tensor of shape \(8, 4\), \[1\]: tensor of "
                                           r"shape \(\), \[2\]: tensor of shape \(\)\) with 2 \(\[1\], \[2\]\) scalar "
                                           r"floating-point tensor\(s\), so its loss is ambiguous"):
        capture(LogitsAndLoss(second_scalar=True), _batch(), tracer="export")
