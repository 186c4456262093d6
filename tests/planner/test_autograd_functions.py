"""A custom autograd.Function whose backward is not its forward's gradient is refused at capture.

torch.export traces into ``Function.forward`` and the rank graphs are differentiated op by op, so a
straight-through estimator written as a Function (``forward: x.round()``, ``backward: grad``, as
quantized and VQ models write it) trained, on one device, with round's gradient: the encoder's
gradient 0 where one process's is 0.50 (losses 1.504, 1.122, 1.137 against 1.504, 1.115, 1.091),
silently. A Function whose backward is its forward's gradient (BLOOM's hand-written GeLU) captures.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.capture import CaptureError, capture

_APPLY = torch.autograd.Function.__dict__["apply"]


class RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.round()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g


class GeLUFunction(torch.autograd.Function):  # BLOOM's: the backward is the tanh GeLU's derivative
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        ff = 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)
        return ff * g


class Scale(torch.autograd.Function):  # forward without ctx, setup_context apart
    @staticmethod
    def forward(x, s):  # type: ignore[no-untyped-def]
        return x * s

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        ctx.s = inputs[1]

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g * ctx.s, None


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.enc, self.dec = nn.Linear(8, 4), nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        if self.kind == "ste":
            h = RoundSTE.apply(h * 3) / 3
        elif self.kind == "gelu":
            h = GeLUFunction.apply(h)
        elif self.kind == "scale":
            h = Scale.apply(h, math.pi)
        else:  # torch's reentrant checkpoint is a Function of torch's own
            h = checkpoint(torch.tanh, h, use_reentrant=True)
        return F.mse_loss(self.dec(h), x)


def _batch() -> tuple[torch.Tensor]:
    return (torch.randn(8, 8, generator=torch.Generator().manual_seed(0)),)


def test_a_straight_through_function_is_refused_at_capture() -> None:
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match=r"could not capture Net: its forward calls the custom autograd.Function "
                                           r"RoundSTE \(op RoundSTE.apply at module <model top level> \(Net\), source "
                                           r"test_autograd_functions.py:\d+\), whose backward is not the gradient of "
                                           r"its forward .* What to do: write the estimator with detach"):
        capture(Net("ste"), _batch())
    assert torch.autograd.Function.__dict__["apply"] is _APPLY  # the watch put torch's own back


def test_a_function_in_the_projects_own_model_code_is_checked() -> None:
    """The corpus's finite scalar quantizer (its Function lives under fairscale/testing) trained dp4 with
    round's zero gradient (gradients 45% off) while the check passed over the project's own modules."""
    from fairscale.testing.corpus_styles_gen import STEQuantizer

    torch.manual_seed(0)
    with pytest.raises(CaptureError, match=r"autograd.Function RoundSTE \(op RoundSTE.apply at module vq \(FSQ\), "
                                           r"source corpus_styles_gen.py:\d+\)"):
        capture(STEQuantizer(), (torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16)),
                loss_fn=lambda out, x: F.mse_loss(out[1], x))


@pytest.mark.parametrize("kind", ["gelu", "scale", "checkpoint"])
def test_a_function_whose_backward_is_its_forwards_gradient_captures(kind: str) -> None:
    torch.manual_seed(0)
    model = Net(kind)
    capture(model, _batch())
