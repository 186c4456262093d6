"""Shared by the classic tests of wrappers (checkpoint_wrapper, FlattenParamsWrapper, wrap):
train a wrapped model data-parallel on gloo ranks, and its single-process reference."""

from __future__ import annotations

import io

import torch
import torch.distributed as dist

import fairscale
from fairscale.testing.models import build
from fairscale.testing.reference import Trajectory, train_reference
from planner.capture import LossModule

STEPS, BATCH, LR = 3, 8, 1e-2


def train_data_parallel(wrap, family: str, rank: int, world: int, unwrap) -> Trajectory:
    """Wrap ``build(family)``'s model, train STEPS Adam steps on this rank's slice of the batch."""
    case = build(family)
    model = wrap(case.model)
    loss_mod = LossModule(model, case.loss_fn)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    out = Trajectory()
    per = BATCH // world
    for step in range(STEPS):
        batch = tuple(t[rank * per:(rank + 1) * per] for t in case.make_batch(step, BATCH))
        opt.zero_grad(set_to_none=True)
        loss = loss_mod(*batch)
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        out.losses.append(t.item() / world)
    out.params = {k: v.detach().clone() for k, v in unwrap(model).items()}
    return out


def launch_ranks(fn, world: int) -> list[Trajectory]:
    def run(rank: int, n: int) -> bytes:
        buf = io.BytesIO()
        torch.save(fn(rank, n), buf)
        return buf.getvalue()

    return [torch.load(io.BytesIO(b), weights_only=False) for b in fairscale.launch(run, devices=world)]


def reference(family: str, wrap=lambda m: m) -> Trajectory:
    def make():
        case = build(family)
        case.model = wrap(case.model)
        return case

    return train_reference(make, steps=STEPS, global_batch=BATCH, lr=LR)
