"""ShardedGradScaler on CPU gloo: exact training under OSS + ShardedDataParallel, and agreed inf skips."""

from __future__ import annotations

import io

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: once here, not in every forked rank)
from torch import nn

import fairscale
from fairscale.nn.data_parallel.sharded_ddp import ShardedDataParallel
from fairscale.optim import OSS
from fairscale.optim.grad_scaler import GradScaler, ShardedGradScaler
from fairscale.testing.models import build
from fairscale.testing.reference import Trajectory, compare, train_reference
from passes.ops import comm
from planner.capture import LossModule

STEPS, BATCH, LR = 3, 8, 1e-2


def _pack(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=False)


def _run(rank: int, world: int) -> bytes:
    out: dict = {}
    per = BATCH // world

    # 1. exact training: scaling by 2**16 and unscaling are exact in fp32
    case = build("mlp")
    opt = OSS(case.model.parameters(), optim=torch.optim.Adam, lr=LR)
    model = ShardedDataParallel(case.model, opt)
    scaler = ShardedGradScaler()
    wrapped = LossModule(model, case.loss_fn)
    traj = Trajectory()
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        batch = tuple(t[rank * per:(rank + 1) * per] for t in case.make_batch(step, BATCH))
        loss = wrapped(*batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        g = loss.detach().clone()
        comm.all_reduce_(g, "zero")
        traj.losses.append(g.item() / world)
    traj.params = {k: v.detach().clone() for k, v in case.model.state_dict().items()}
    out["traj"] = traj
    out["scale"] = scaler.get_scale()

    # 2. an inf only in rank 1's own shard: every rank skips the step and backs off
    opt.zero_grad(set_to_none=True)
    wrapped(*case.make_batch(9, BATCH)).backward()
    if rank == 1:
        mine = opt.per_device_params[1][0]
        mine.grad.view(-1)[0] = float("inf")
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    scaler.step(opt)
    scaler.update()
    out["skipped"] = all(torch.equal(before[k], v) for k, v in case.model.state_dict().items())
    out["scale_after_inf"] = scaler.get_scale()

    # 3. a rank that owns no parameter still takes part in the agreement
    lone = nn.Parameter(torch.ones(3))
    opt1 = OSS([lone], optim=torch.optim.SGD, lr=1.0)
    s1 = ShardedGradScaler(init_scale=4.0)
    s1.scale((lone * 2).sum()).backward()
    s1.step(opt1)
    s1.update()
    out["lone"] = lone.detach().clone()
    out["lone_scale"] = s1.get_scale()
    return _pack(out)


@pytest.fixture(scope="module", params=[2, 4])
def runs(request):
    return request.param, [_unpack(r) for r in fairscale.launch(_run, devices=request.param)]


def test_sharded_scaler_trains_exactly(runs) -> None:
    ref = train_reference(lambda: build("mlp"), steps=STEPS, global_batch=BATCH, lr=LR)
    _, results = runs
    for r in results:
        compare(ref, r["traj"])
        assert r["scale"] == 2.0**16


def test_inf_on_one_shard_skips_everywhere(runs) -> None:
    _, results = runs
    for r in results:
        assert r["skipped"]
        assert r["scale_after_inf"] == 2.0**15


def test_rank_without_parameters_agrees(runs) -> None:
    _, results = runs
    for r in results:
        torch.testing.assert_close(r["lone"], torch.full((3,), -1.0))  # 1 - lr * 2
        assert r["lone_scale"] == 4.0


def test_grad_scaler_works_on_cpu() -> None:
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([w], lr=0.5)
    scaler = GradScaler(init_scale=8.0, growth_interval=1)
    loss = (w ** 2).sum()
    assert scaler.scale(loss).item() == 8.0 * loss.item()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    torch.testing.assert_close(w.detach(), torch.tensor([0.0, 0.0]))  # w - 0.5 * 2w
    assert scaler.get_scale() == 16.0  # grew after one clean step


def test_sharded_scaler_without_process_group() -> None:
    w = nn.Parameter(torch.tensor([3.0]))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler = ShardedGradScaler(init_scale=2.0)
    scaler.scale((w * float("inf")).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert w.item() == 3.0 and scaler.get_scale() == 1.0
