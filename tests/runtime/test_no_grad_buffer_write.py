"""An in-place update under ``torch.no_grad()`` in the forward: DINO's center, a momentum encoder.

``torch.export`` wraps a ``torch.no_grad()`` block in a higher-order op
(``wrap_with_set_grad_enabled``) whose body holds the block's ops. DINO's center update
(``self.center.mul_(m).add_(batch_center * (1 - m))`` under ``no_grad``) returns nothing, and the
stage split took the call for dead code: every plan, tp4 included, trained with the center at zero
(4.2% off at the second step), silently. And ``planner.buffer_writes`` looked only at the top graph,
so plans that cut the batch were not refused for it (nor for a momentum teacher's EMA of its
parameters in forward, which 2 microbatches applied twice per step). The split keeps a
higher-order op whose body writes (``passes.stage_blueprint.has_effects``), and the buffer-write
scan walks the bodies, parameters included.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.testing.models import Case
from fairscale.testing.reference import RankResult, compare_grads, rank_trajectory, train_on_rank, train_reference
from planner.buffer_writes import find_buffer_writes
from planner.capture import capture
from planner.plan import Plan, PlanError


class Centered(nn.Module):
    """DINO's loss against a frozen teacher, its center updated under no_grad; ``ema``: the teacher
    also follows the student by an EMA of its parameters, in forward (MoCo's habit)."""

    def __init__(self, ema: bool = False) -> None:
        super().__init__()
        self.student, self.teacher = nn.Linear(12, 16), nn.Linear(12, 16)
        self.teacher.requires_grad_(False)
        self.register_buffer("center", torch.zeros(1, 16))
        self.ema = ema

    def forward(self, v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        if self.ema:
            with torch.no_grad():
                for ps, pt in zip(self.student.parameters(), self.teacher.parameters()):
                    pt.mul_(0.99).add_(0.01 * ps.detach())
        t = self.teacher(v2).detach()
        q = F.softmax((t - self.center) / 0.04, dim=-1)
        loss = torch.sum(-q * F.log_softmax(self.student(v1) / 0.1, dim=-1), dim=-1).mean()
        with torch.no_grad():
            self.center.mul_(0.9).add_(t.mean(0, keepdim=True) * 0.1)
        return loss


def _batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(rows, 12, generator=g)
    return x + 0.1 * torch.randn(rows, 12, generator=g), x + 0.1 * torch.randn(rows, 12, generator=g)


def _case() -> Case:
    torch.manual_seed(0)
    return Case("centered", Centered(), _batch, None)


def test_writes_under_no_grad_are_found_and_refused_for_plans_that_cut_the_batch() -> None:
    torch.manual_seed(0)
    writes = find_buffer_writes(capture(Centered(ema=True), _batch(0), annotate=False).gm)
    assert {w.buffer for w in writes} == {"center", "teacher.weight", "teacher.bias"}, writes
    assert all("test_no_grad_buffer_write.py:" in w.source for w in writes)
    with pytest.raises(PlanError, match="writes the buffer"):
        fairscale.plan(Centered(), _batch(0), devices=2, constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})


def _train(rank: int, world: int, plan: Plan) -> RankResult:
    return train_on_rank(_case(), plan, optimizer=functools.partial(torch.optim.SGD, lr=0.1))


def test_the_center_updated_under_no_grad_trains_as_one_process() -> None:
    plan = fairscale.plan(_case().model, _batch(0), devices=2, constraints={"mesh": {"pp": 2, "dp": 1, "tp": 1},
                                                                           "schedule": {"microbatches": 1}})
    reference = train_reference(_case, steps=3, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    compare_grads(reference, rank_trajectory(fairscale.launch(_train, devices=2, args=(plan,))[0]))
