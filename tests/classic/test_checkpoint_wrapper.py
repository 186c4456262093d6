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


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 3),
                         nn.BatchNorm2d(2, momentum=None))  # momentum None: cumulative average


@pytest.mark.parametrize("offload", [False, True])
def test_batch_norm_statistics_update_once_per_step(offload):
    """FairScale 0.4.13 keeps batch-norm statistics as if there were no checkpointing: the backward
    recomputation must not update running_mean/var or num_batches_tracked a second time."""
    plain, wrapped = _bn_net(), checkpoint_wrapper(_bn_net(), offload_to_cpu=offload)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_w = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step))
        for model, opt in ((plain, opt_p), (wrapped, opt_w)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    assert int(wrapped[1].num_batches_tracked) == 3 and int(wrapped[4].num_batches_tracked) == 3
    for (k, a), b in zip(plain.state_dict().items(), wrapped.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=k)
    # with disable_checkpointing() the module runs plainly: no recomputation at all
    from fairscale.nn.checkpoint import disable_checkpointing

    counted = checkpoint_wrapper(Counted())
    with disable_checkpointing():
        counted(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert counted.calls == 1 and counted.flags == [(False, False)]


def test_misc_alias():
    from fairscale.nn.misc import checkpoint_wrapper as misc_checkpoint_wrapper

    assert misc_checkpoint_wrapper is checkpoint_wrapper


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
