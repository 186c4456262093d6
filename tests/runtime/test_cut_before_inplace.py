"""A pipeline cut right before an in-place op (issue 12, item 8): the received activation is a leaf
on its stage, and autograd refuses in-place ops on leaves that require grad ("a leaf Variable that
requires grad is being used in an in-place operation", after launch). The stage split copies a
received value that the stage mutates in place, and the plan trains like one process."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from planner.plan import Mesh, Plan, Schedule, Stage


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv(x))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b0 = nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = Block(8)
        self.b2 = Block(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu_(self.b0(x))  # the cut below b0 lands right before this in-place op
        return self.head(self.b2(self.b1(x)).mean((2, 3)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _rank(rank: int, world: int, model: nn.Module) -> list[float]:
    plan = Plan(mesh=Mesh(pp=2), schedule=Schedule(microbatches=2, global_batch=8),
                stages=[Stage(layers="b0"), Stage(layers="b1, b2, head")])
    pm = fairscale.parallelize(model, example_inputs=_batch(0), loss_fn=F.cross_entropy, plan=plan)
    return [pm.train_step(_batch(s)) for s in range(3)]


def test_a_cut_before_an_inplace_op_trains_like_one_process() -> None:
    torch.manual_seed(0)
    model = CNN()
    ref_model = copy.deepcopy(model)
    got = fairscale.launch(_rank, devices=2, args=(model,))[0]
    opt = torch.optim.Adam(ref_model.parameters(), lr=1e-3)
    ref = []
    for s in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(ref_model(_batch(s)[0]), _batch(s)[1])
        loss.backward()
        opt.step()
        ref.append(loss.item())
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, ref)), (got, ref)
