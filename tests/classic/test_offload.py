"""OffloadModel trains exactly like the plain nn.Sequential: on the CPU-only configuration
(device == offload_device), on the forced-copy path that GPU transfers use, and under DDP on
2 and 4 gloo ranks."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fairscale
from fairscale.experimental.nn import OffloadModel
from fairscale.experimental.nn.offload import _split_balanced
from fairscale.testing.reference import Trajectory, compare

STEPS, BATCH, LR = 3, 8, 1e-2


def _seq(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def _batch(step: int, n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def _train(model: nn.Module, rank: int = 0, world: int = 1) -> Trajectory:
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    out = Trajectory()
    per = BATCH // world
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        out.losses.append(t.item() / world)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    seq = inner.model if isinstance(inner, OffloadModel) else inner
    out.params = {k: v.detach().clone() for k, v in seq.state_dict().items()}
    return out


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("force", [False, True])
def test_trains_exactly(ckpt, micro, force):
    ref = _train(_seq())
    model = OffloadModel(_seq(), device=torch.device("cpu"), offload_device=torch.device("cpu"), num_slices=3,
                         checkpoint_activation=ckpt, num_microbatches=micro)
    model._force_copies = force
    compare(ref, _train(model))
    if force and not ckpt:
        assert model._packed > 0  # parameter copies were replaced by tokens and re-copied in backward


def test_slices_are_balanced_and_cover_every_layer():
    assert _split_balanced([10, 0, 10, 0, 10, 0, 10], 3) == [(0, 3), (3, 5), (5, 7)]
    assert _split_balanced([5, 5], 3) == [(0, 1), (1, 2)]
    assert _split_balanced([0, 0, 0], 2) == [(0, 2), (2, 3)]
    model = OffloadModel(_seq(), device="cpu", num_slices=3)
    assert model.slices[0][0] == 0 and model.slices[-1][1] == 7
    assert all(a < b for a, b in model.slices)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_errors_name_the_fix():
    with pytest.raises(TypeError, match="needs an nn.Sequential"):
        OffloadModel(nn.Linear(2, 2), device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="on a CPU-only machine pass device='cpu'"):
            OffloadModel(_seq(), device="cuda")


def _ddp_run(rank: int, world: int) -> bytes:
    model = OffloadModel(_seq(), device="cpu", num_slices=3, checkpoint_activation=True, num_microbatches=2)
    model._force_copies = True
    buf = io.BytesIO()
    torch.save(_train(nn.parallel.DistributedDataParallel(model), rank, world), buf)
    return buf.getvalue()


@pytest.mark.parametrize("world", [2, 4])
def test_under_ddp_on_gloo_ranks(world):
    ref = _train(_seq())
    for data in fairscale.launch(_ddp_run, devices=world):
        compare(ref, torch.load(io.BytesIO(data), weights_only=False))
