"""A forward that writes its own weights where no trace records them is refused at capture
(planner.eager_writes), and the capture leaves the weights as they were.

DINO / BYOL update a momentum teacher inside forward; written through ``.data``, torch.export
cannot trace it and torch.fx ran the update once, eagerly, while tracing: the graph had no update,
the user's teacher had moved one step at plan time, and the plan check refused every plan with a
message about pipeline stages. Written without ``.data`` under ``torch.no_grad()`` (what the
refusal says to do), export records the write.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fairscale
from planner.capture import CaptureError, capture
from planner.graph import bodies


class MomentumTeacher(nn.Module):
    def __init__(self, via_data: bool = True) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 6))
        self.teacher = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 6))
        self.teacher.requires_grad_(False)
        self.via_data = via_data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.student(x)
        with torch.no_grad():
            t = self.teacher(x)
        loss = torch.sum(-torch.softmax(t / 0.04, -1) * torch.log_softmax(s / 0.1, -1), -1).mean()
        with torch.no_grad():
            for ps, pt in zip(self.student.parameters(), self.teacher.parameters()):
                if self.via_data:
                    pt.data.mul_(0.99).add_(0.01 * ps.detach().data)  # the line the refusal names
                else:
                    pt.mul_(0.99).add_(ps.detach(), alpha=0.01)
        return loss


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tracer", ["auto", "fx"])
def test_a_write_through_data_is_refused_naming_the_tensor_and_line(tracer: str) -> None:
    model = MomentumTeacher()
    before = _weights(model)
    with pytest.raises(CaptureError) as err:
        capture(model, (torch.randn(4, 8),), tracer=tracer)
    msg = str(err.value)
    assert "writes its parameter teacher.0.weight in place" in msg
    assert "test_eager_writes.py:38" in msg and "without .data" in msg
    for k, v in _weights(model).items():
        assert torch.equal(v, before[k]), f"the capture changed {k}"


def test_the_public_api_refuses_before_launch() -> None:
    with pytest.raises(CaptureError, match="writes its parameter teacher.0.weight"):
        fairscale.plan(MomentumTeacher(), (torch.randn(4, 8),), devices=2)


def _writes(gm: torch.fx.GraphModule) -> list[str]:
    """The in-place adds of ``gm`` and of the bodies of its higher-order ops."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    found = [str(n.target) for n in nodes if str(n.target).startswith("aten.add_")]
    return found + [w for n in nodes for body in bodies(n, gm) for w in _writes(body)]


def test_the_remedy_is_captured_with_the_write() -> None:
    graph = capture(MomentumTeacher(via_data=False), (torch.randn(4, 8),))
    assert len(_writes(graph.gm)) == 4, "the teacher's update is not in the graph"


def test_a_buffer_write_fx_cannot_record_falls_back_to_export() -> None:
    """torch.fx proxies parameters, not buffers: ``self.seen.add_(1)`` ran eagerly while tracing
    and was lost (a model on meta is traced with fx first). fx now stops before the write and
    export, which records it, traces the model; fx alone refuses it."""

    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.add_(1)
            return self.lin(x).pow(2).mean()

    with torch.device("meta"):
        model = Counter()
    graph = capture(model, (torch.randn(2, 4, device="meta"),))
    assert _writes(graph.gm) == ["aten.add_.Tensor"]
    model = Counter()
    with pytest.raises(CaptureError, match="writes its buffer seen in place"):
        capture(model, (torch.randn(2, 4),), tracer="fx")
    assert model.seen.item() == 0


class L2InForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        penalty = sum(p.pow(2).sum() for p in self.parameters())
        return self.b(self.a(x)).mean() + 1e-2 * penalty


def test_a_parameter_read_fx_would_make_a_constant_is_refused_or_exported() -> None:
    """fx kept an L2 penalty over ``self.parameters()`` as a constant: the penalty's gradient was
    lost. fx alone refuses it; on meta (fx first) export traces it, with the penalty's ops."""
    with pytest.raises(CaptureError, match=r"computes from its parameter a.weight where torch.fx does not track it"):
        capture(L2InForward(), (torch.randn(3, 4),), tracer="fx")
    with torch.device("meta"):
        model = L2InForward()
    graph = capture(model, (torch.randn(3, 4, device="meta"),))
    assert graph.tracer == "export"
    assert sum(str(n.target).startswith("aten.pow") for n in graph.gm.graph.nodes) == 4


class FirstHidden(nn.Module):
    """PyTorch's word_language_model: the first hidden state from ``next(self.parameters()).new_zeros``."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.out = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = next(self.parameters()).new_zeros(1, 4)
        return self.out(torch.tanh(self.rnn(x) + h)).mean()


def test_a_parameter_read_for_its_shape_alone_is_traced_by_fx() -> None:
    """``new_zeros`` reads a parameter's shape, dtype and device, not its values: fx's constant is
    what every step computes. The parameter-read watch had refused it under tracer='fx' (and made
    a model on meta fall back to export)."""
    graph = capture(FirstHidden(), (torch.randn(3, 4),), tracer="fx")
    assert graph.tracer == "fx"
    with torch.device("meta"):
        model = FirstHidden()
    assert capture(model, (torch.randn(3, 4, device="meta"),)).tracer == "fx"


class MoCoAssign(nn.Module):
    """MoCo's official momentum update: ``param_k.data = param_k.data * m + param_q.data * (1 - m)``."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 4), nn.Linear(8, 4)
        self.k.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for pq, pk in zip(self.q.parameters(), self.k.parameters()):
                pk.data = pk.data * 0.9 + pq.data * 0.1  # the line the refusal names
            t = self.k(x)
        return (self.q(x) - t).pow(2).mean()


@pytest.mark.parametrize("tracer", ["auto", "fx"])
def test_an_assignment_to_data_is_refused_and_the_teacher_left_as_it_was(tracer: str) -> None:
    """Export cannot trace MoCo's update, and the fx fallback ran it while tracing (no op the
    dispatch watch sees: ``.data =`` swaps the tensor): the user's key encoder moved a step at plan
    time, and the graph trained with a key encoder that never moved, silently."""
    model = MoCoAssign()
    before = [p.detach().clone() for p in model.k.parameters()]
    with pytest.raises(CaptureError, match=r"writes its parameter k.weight in place where no trace records it, op "
                                           r"Tensor.data = at module <model top level> \(MoCoAssign\), source "
                                           r"test_eager_writes.py:\d+"):
        capture(model, (torch.randn(3, 8),), tracer=tracer)
    assert all(torch.equal(a, b) for a, b in zip(before, model.k.parameters()))
    assert "data" not in torch.Tensor.__dict__
