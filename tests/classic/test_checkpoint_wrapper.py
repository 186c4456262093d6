"""checkpoint_wrapper: same module and keys, forward recomputed in backward, identical gradients
(with and without offload_to_cpu), keyword arguments; exact training under DDP on 2 and 4 ranks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fairscale.nn import checkpoint_wrapper
from fairscale.nn.checkpoint import is_checkpointing, is_recomputing
from fairscale.testing.reference import compare

from classic_harness import launch_ranks as _launch, reference as _reference, train_data_parallel as _train_data_parallel


def _checkpoint_blocks(model: nn.Module, offload: bool = False) -> nn.Module:
    for block in model.layers:
        checkpoint_wrapper(block, offload_to_cpu=offload)
    return model


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.flags: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        self.calls += 1
        self.flags.append((is_checkpointing(), is_recomputing()))
        return torch.tanh(self.lin(x)) * scale


@pytest.mark.parametrize("offload", [False, True])
def test_recomputes_in_backward_with_identical_grads(offload):
    torch.manual_seed(0)
    plain = Counted()
    wrapped = copy.deepcopy(plain)
    assert checkpoint_wrapper(wrapped, offload_to_cpu=offload) is wrapped
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    x = torch.randn(3, 4, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    plain(x, scale=2.0).sum().backward()
    wrapped(x2, scale=2.0).sum().backward()
    assert wrapped.calls == 2 and plain.calls == 1
    assert wrapped.flags == [(True, False), (False, True)]
    assert torch.equal(x.grad, x2.grad)
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_no_grad_runs_once():
    m = checkpoint_wrapper(Counted())
    with torch.no_grad():
        m(torch.randn(2, 4))
    assert m.calls == 1


def test_rejects_non_modules():
    with pytest.raises(TypeError, match="expects an nn.Module"):
        checkpoint_wrapper(lambda x: x)


def test_single_process_trains_exactly():
    compare(_reference("gpt"), _reference("gpt", lambda m: _checkpoint_blocks(m, offload=True)))


@pytest.mark.parametrize("world", [2, 4])
def test_trains_exactly_under_ddp(world):
    ref = _reference("mlp")
    fn = lambda rank, n: _train_data_parallel(  # noqa: E731
        lambda m: nn.parallel.DistributedDataParallel(_checkpoint_blocks(m, offload=True)), "mlp", rank, n,
        lambda m: m.module.state_dict())
    for got in _launch(fn, world):
        compare(ref, got)
