"""AdaScale: the gain formula by hand, and data-parallel ranks == one process accumulating."""

from __future__ import annotations

import io

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: once here, not in every forked rank)
import torch.distributed as dist
from torch import nn

import fairscale
from fairscale.optim import AdaScale, AdaScaleWrapper
from fairscale.testing.models import build
from planner.capture import LossModule

BATCH, STEPS = 8, 3


def _pack(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=False)


def _backward_with_grad(w: nn.Parameter, g: list[float]) -> None:
    (w * torch.tensor(g)).sum().backward()  # d/dw = g


def test_gain_by_hand_single_process_accumulation() -> None:
    w = nn.Parameter(torch.zeros(2))
    opt = AdaScale(torch.optim.SGD([w], lr=0.1), num_gradients_to_accumulate=2, smoothing=0.5)
    assert opt.scale == 2.0
    # step 1: g1 = [3, 1], g2 = [1, 1];  ḡ = [2, 1], ‖ḡ‖² = 5, mean ‖g_i‖² = (10 + 2) / 2 = 6
    # σ² = S/(S-1)·(6 - 5) = 2;  μ² = 5 - σ²/S = 4;  gain = (2 + 4) / (2/2 + 4) = 1.2
    _backward_with_grad(w, [3.0, 1.0])
    _backward_with_grad(w, [1.0, 1.0])
    opt.step()
    assert opt.gain() == pytest.approx(1.2)
    torch.testing.assert_close(w.detach(), -0.1 * 1.2 * torch.tensor([2.0, 1.0]))
    # step 2: g1 = [1, 0], g2 = [0, 1]: ḡ = [.5, .5], ‖ḡ‖² = .5, mean ‖g_i‖² = 1 -> σ² = 1, μ² = 0
    # bias-corrected EMA with factor .5 after two values v1, v2 is (.25 v1 + .5 v2) / .75
    opt.zero_grad()
    _backward_with_grad(w, [1.0, 0.0])
    _backward_with_grad(w, [0.0, 1.0])
    before = w.detach().clone()
    opt.step()
    var = (0.25 * 2 + 0.5 * 1) / 0.75
    sqr = (0.25 * 4 + 0.5 * 0) / 0.75
    gain = (var + sqr) / (var / 2 + sqr)
    assert opt.gain() == pytest.approx(gain)
    torch.testing.assert_close(w.detach(), before - 0.1 * gain * torch.tensor([0.5, 0.5]))
    assert opt.param_groups[0]["lr"] == 0.1  # the gain applies to one step only


def test_scale_one_gain_is_one_and_set_scale() -> None:
    w = nn.Parameter(torch.zeros(2))
    opt = AdaScaleWrapper([w], optim_cls=torch.optim.SGD, lr=0.1)
    _backward_with_grad(w, [1.0, 2.0])
    opt.step()
    assert opt.scale == 1.0 and opt.gain() == 1.0
    opt.set_scale(4.0)
    assert opt.scale == 4.0
    with pytest.raises(ValueError, match="scale must be >= 1"):
        opt.set_scale(0.5)


def test_unsupported_uses_raise() -> None:
    w = nn.Parameter(torch.zeros(2))
    opt = AdaScale(torch.optim.SGD([w], lr=0.1))
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(ValueError, match="needs torch.distributed initialized"):
        AdaScale(torch.optim.SGD([w], lr=0.1), world_size=2)


def _single_process(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process accumulating the ``world`` ranks' batches: the same S gradients per step."""
    case = build("mlp")
    wrapped = LossModule(case.model, case.loss_fn)
    opt = AdaScale(torch.optim.SGD(case.model.parameters(), lr=0.1, momentum=0.9),
                   num_gradients_to_accumulate=world)
    per, gains = BATCH // world, []
    for step in range(STEPS):
        opt.zero_grad()
        batch = case.make_batch(step, BATCH)
        for r in range(world):
            wrapped(*(t[r * per:(r + 1) * per] for t in batch)).backward()
        opt.step()
        gains.append(opt.gain())
    return gains, {k: v.clone() for k, v in case.model.state_dict().items()}


def _run(rank: int, world: int) -> bytes:
    case = build("mlp")
    wrapped = LossModule(case.model, case.loss_fn)
    opt = AdaScale(torch.optim.SGD(case.model.parameters(), lr=0.1, momentum=0.9))
    per, gains = BATCH // world, []
    for step in range(STEPS):
        opt.zero_grad()
        batch = case.make_batch(step, BATCH)
        wrapped(*(t[rank * per:(rank + 1) * per] for t in batch)).backward()
        for p in case.model.parameters():  # data parallel: average the gradients
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        opt.step()
        gains.append(opt.gain())
    # the same under torch's DistributedDataParallel (its hooks average the gradients)
    case2 = build("mlp")
    ddp = nn.parallel.DistributedDataParallel(case2.model)
    wrapped2 = LossModule(ddp, case2.loss_fn)
    opt2 = AdaScale(torch.optim.SGD(case2.model.parameters(), lr=0.1, momentum=0.9))
    ddp_gains = []
    for step in range(STEPS):
        opt2.zero_grad()
        batch = case2.make_batch(step, BATCH)
        wrapped2(*(t[rank * per:(rank + 1) * per] for t in batch)).backward()
        opt2.step()
        ddp_gains.append(opt2.gain())
    # the hand example, with its two gradients on two different ranks (ranks >= 2 repeat them)
    w = nn.Parameter(torch.zeros(2))
    hand = AdaScale(torch.optim.SGD([w], lr=0.1), world_size=world)
    _backward_with_grad(w, [3.0, 1.0] if rank % 2 == 0 else [1.0, 1.0])
    dist.all_reduce(w.grad)
    w.grad.div_(world)
    hand.step()
    return _pack({"scale": opt.scale, "gains": gains, "ddp_gains": ddp_gains, "params": dict(case.model.state_dict()),
                  "hand_gain": hand.gain()})


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_match_single_process_accumulation(world: int) -> None:
    results = [_unpack(r) for r in fairscale.launch(_run, devices=world)]
    gains, params = _single_process(world)
    assert all(g > 1.0 for g in gains)  # the gain is active
    for r in results:
        assert r["scale"] == world
        assert r["gains"] == pytest.approx(gains, rel=1e-5)
        assert r["ddp_gains"] == pytest.approx(gains, rel=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(r["params"][k], v, rtol=1e-5, atol=1e-5)
        # ḡ = [2, 1], ‖ḡ‖² = 5, mean ‖g_i‖² = 6; σ² = S/(S-1), μ² = 5 - σ²/S
        s = float(world)
        var = s / (s - 1)
        sqr = 5 - var / s
        assert r["hand_gain"] == pytest.approx((var + sqr) / (var / s + sqr))
