"""A model neither tracer can handle gets a CaptureError that names its source line and what to do."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from planner.capture import CaptureError, capture


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return -x


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.inp(x)).pow(2).mean()


LINE = inspect.getsourcelines(Gate.forward)[1] + 1  # the `if x.sum() > 0:` line


def test_data_dependent_branch_names_the_line_and_the_fixes():
    with pytest.raises(CaptureError) as info:
        capture(Branchy(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert msg.startswith("could not capture Branchy: neither torch.export nor torch.fx can trace it.\n")
    assert f"  torch.export failed at {__file__}:{LINE} in forward (Gate): `if x.sum() > 0:`" in msg
    assert f"  torch.fx failed at {__file__}:{LINE} in forward (Gate): `if x.sum() > 0:`" in msg
    assert "    TraceError: symbolically traced variables cannot be used as inputs to control flow" in msg
    assert f"  - remove data-dependent control flow at {__file__}:{LINE} (branch with torch.where, or torch.cond)" in msg
    assert "  - mark Gate as a leaf: capture(..., tracer='fx', leaf_modules=(Gate,))" in msg
    assert "  - pass concrete_args={'batch_0': ...}" in msg


def test_following_the_advice_captures_the_model():
    """Marked as a leaf, fx keeps Gate as one opaque node and the graph runs; its FLOPs cannot be
    counted on fake tensors (the branch needs x's value), and capture says so and what to do."""
    model = Branchy()
    x = torch.randn(2, 4)
    with pytest.raises(CaptureError) as info:
        capture(model, (x,), leaf_modules=(Gate,))
    msg = str(info.value)
    assert msg.startswith("captured Branchy with torch.fx, but cannot compute facts for %model_gate : "
                          "[num_users=1] = call_module[target=model.gate](args = (%linear,), kwargs = {}) "
                          f"on fake tensors at {__file__}:{LINE}: `if x.sum() > 0:`")
    assert "capture with annotate=False: the graph still runs" in msg
    graph = capture(model, (x,), leaf_modules=(Gate,), annotate=False)
    assert graph.tracer == "fx"
    assert [n.target for n in graph.gm.graph.nodes if n.op == "call_module"] == ["model.gate"]
    assert [layer.name for layer in graph.layers] == ["inp", "gate"]
    assert graph.layer("gate").params == ["gate.fc.weight", "gate.fc.bias"]
    torch.testing.assert_close(graph.gm(x), model(x))


def test_single_tracer_failure_says_cannot():
    with pytest.raises(CaptureError, match=r"^could not capture Branchy: torch.fx cannot trace it.\n"):
        capture(Branchy(), (torch.randn(2, 4),), tracer="fx")


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, square: bool) -> torch.Tensor:
        y = self.fc(x)
        if square:
            y = y * y
        return y.mean()


def test_concrete_args_fix_a_python_branch_for_fx():
    model, x = Flagged(), torch.randn(2, 4)
    graph = capture(model, (x, True), tracer="fx", concrete_args={"batch_1": True})
    assert graph.tracer == "fx"
    torch.testing.assert_close(graph.gm(x, True), model(x, True))
    assert graph.flops_per_step == 2 * 2 * 4 * 4 * 2  # fwd + weight grad; x needs no gradient
    with pytest.raises(ValueError, match=r"^tracer='fx' takes a flat tuple of tensors as example_inputs \(other "):
        capture(model, (x, True), tracer="fx")
