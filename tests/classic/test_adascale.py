"""AdaScale against FairScale 0.4.13's documented semantics: the gain formula by hand, gain() known
before step(), scaled and unscaled accumulated losses, state in the optimizer's state dict, and
data-parallel ranks (by hand, under DDP, and over OSS) == one process accumulating scaled losses."""

from __future__ import annotations

import io

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: once here, not in every forked rank)
from torch import nn

import fairscale
from fairscale.optim import OSS, AdaScale, AdaScaleWrapper
from fairscale.testing.models import build
from planner.capture import LossModule

BATCH, STEPS = 8, 3


def _pack(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=False)


def _backward_with_grad(w: nn.Parameter, g: list[float], *, divide: float = 1.0) -> None:
    (w * torch.tensor(g)).sum().div(divide).backward()  # d/dw = g / divide


def test_gain_by_hand_single_process_accumulation() -> None:
    w = nn.Parameter(torch.zeros(2))
    opt = AdaScale(torch.optim.SGD([w], lr=0.1), num_gradients_to_accumulate=2, smoothing=0.5)
    assert opt.scale == 2.0
    # step 1: g1 = [3, 1], g2 = [1, 1];  ḡ = [2, 1], ‖ḡ‖² = 5, mean ‖g_i‖² = (10 + 2) / 2 = 6
    # σ² = S/(S-1)·(6 - 5) = 2;  μ² = 5 - σ²/S = 4;  gain = (2 + 4) / (2/2 + 4) = 1.2
    # is_scaled_loss=True (FairScale's default): each pass's loss is divided by k = 2
    _backward_with_grad(w, [3.0, 1.0], divide=2)
    _backward_with_grad(w, [1.0, 1.0], divide=2)
    assert opt.gain() == pytest.approx(1.2)  # known as soon as the step's last backward ended
    torch.testing.assert_close(w.grad, torch.tensor([2.0, 1.0]))
    opt.step()
    torch.testing.assert_close(w.grad, torch.tensor([2.0, 1.0]))  # step() leaves gradients alone
    torch.testing.assert_close(w.detach(), -0.1 * 1.2 * torch.tensor([2.0, 1.0]))
    # step 2: g1 = [1, 0], g2 = [0, 1]: ḡ = [.5, .5], ‖ḡ‖² = .5, mean ‖g_i‖² = 1 -> σ² = 1, μ² = 0
    # bias-corrected EMA with factor .5 after two values v1, v2 is (.25 v1 + .5 v2) / .75
    opt.zero_grad()
    _backward_with_grad(w, [1.0, 0.0], divide=2)
    _backward_with_grad(w, [0.0, 1.0], divide=2)
    before = w.detach().clone()
    var = (0.25 * 2 + 0.5 * 1) / 0.75
    sqr = (0.25 * 4 + 0.5 * 0) / 0.75
    gain = (var + sqr) / (var / 2 + sqr)
    assert opt.gain() == pytest.approx(gain)
    opt.step()
    torch.testing.assert_close(w.detach(), before - 0.1 * gain * torch.tensor([0.5, 0.5]))
    assert opt.param_groups[0]["lr"] == 0.1  # the gain applies to one step only


def test_unscaled_loss_needs_scale_grad_by_num_grads_to_accum() -> None:
    """is_scaled_loss=False: .grad holds the sum; scale_grad_by_num_grads_to_accum() makes it the
    mean, and the update is the same as with scaled losses (FairScale 0.4.13's two modes)."""
    w_scaled, w_unscaled = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    scaled = AdaScale(torch.optim.SGD([w_scaled], lr=0.1), num_gradients_to_accumulate=2)
    unscaled = AdaScale(torch.optim.SGD([w_unscaled], lr=0.1), num_gradients_to_accumulate=2,
                        is_scaled_loss=False)
    for g in ([3.0, 1.0], [1.0, 1.0]):
        _backward_with_grad(w_scaled, g, divide=2)
        _backward_with_grad(w_unscaled, g)
    torch.testing.assert_close(w_unscaled.grad, torch.tensor([4.0, 2.0]))
    with pytest.raises(AssertionError, match="is_scaled_loss=False"):
        scaled.scale_grad_by_num_grads_to_accum()
    unscaled.scale_grad_by_num_grads_to_accum()
    assert unscaled.gain() == pytest.approx(scaled.gain())
    scaled.step()
    unscaled.step()
    torch.testing.assert_close(w_unscaled.detach(), w_scaled.detach())
    # default smoothing is FairScale's max(1 - world × k / 1000, 0)
    assert scaled.smoothing == pytest.approx(0.998)


def test_one_gradient_per_step_is_refused_and_set_scale() -> None:
    w = nn.Parameter(torch.zeros(2))
    with pytest.raises(RuntimeError, match="at least two gradients per step"):
        AdaScale(torch.optim.SGD([w], lr=0.1))
    opt = AdaScaleWrapper([w], optim_cls=torch.optim.SGD, lr=0.1, num_gradients_to_accumulate=2)
    assert opt.scale == 2.0 and opt.gain() == 1.0  # μ² = 1, σ² = 0 before the first step
    opt.set_scale(4.0)
    assert opt.scale == 4.0
    with pytest.raises(ValueError, match="scale must be >= 1"):
        opt.set_scale(0.5)
    with pytest.raises(ValueError, match="needs torch.distributed initialized"):
        AdaScale(torch.optim.SGD([w], lr=0.1), world_size=2)


def test_unhook_and_state_dict_round_trip() -> None:
    w = nn.Parameter(torch.zeros(2))
    opt = AdaScale(torch.optim.SGD([w], lr=0.1, momentum=0.9), num_gradients_to_accumulate=2)
    assert len(opt._hook_handles) == 1
    _backward_with_grad(w, [3.0, 1.0], divide=2)
    _backward_with_grad(w, [1.0, 1.0], divide=2)
    opt.step()
    state = opt.state_dict()
    assert "adascale" in state["state"]  # the estimates travel with the optimizer's state
    w2 = nn.Parameter(w.detach().clone())
    opt2 = AdaScale(torch.optim.SGD([w2], lr=0.1, momentum=0.9), num_gradients_to_accumulate=2)
    opt2.load_state_dict(state)
    assert opt2.gain() == pytest.approx(opt.gain())
    opt.unhook()
    assert opt._hook_handles == []
    gain = opt.gain()
    opt.zero_grad()
    _backward_with_grad(w, [9.0, 0.0])
    _backward_with_grad(w, [0.0, 9.0])
    assert opt.gain() == gain  # unhooked: no longer estimating


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
            (wrapped(*(t[r * per:(r + 1) * per] for t in batch)) / world).backward()
        gains.append(opt.gain())
        opt.step()
    return gains, {k: v.clone() for k, v in case.model.state_dict().items()}


class _Dot(nn.Module):
    """``(w · g).sum()``: its gradient is ``g``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.w * g).sum()


def _run(rank: int, world: int) -> bytes:
    per = BATCH // world
    out: dict[str, object] = {}
    # under torch's DistributedDataParallel (its hooks average the gradients inside backward,
    # before AdaScale's end-of-backward estimate), with a plain and a sharded (OSS) optimizer
    for name, make_opt in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
                           ("oss", lambda ps: OSS(ps, torch.optim.SGD, lr=0.1, momentum=0.9))):
        case = build("mlp")
        wrapped = LossModule(nn.parallel.DistributedDataParallel(case.model), case.loss_fn)
        opt = AdaScale(make_opt(case.model.parameters()))
        gains = []
        for step in range(STEPS):
            opt.zero_grad()
            batch = case.make_batch(step, BATCH)
            wrapped(*(t[rank * per:(rank + 1) * per] for t in batch)).backward()
            gains.append(opt.gain())  # before step(): this step's gain
            opt.step()
        out[name] = {"scale": opt.scale, "gains": gains, "params": dict(case.model.state_dict())}
    # the hand example, with its two gradients on two different ranks (ranks >= 2 repeat them)
    dot = _Dot()
    hand = AdaScale(torch.optim.SGD(dot.parameters(), lr=0.1))
    ddp = nn.parallel.DistributedDataParallel(dot)  # kept alive through backward: it owns the reduction
    ddp(torch.tensor([3.0, 1.0] if rank % 2 == 0 else [1.0, 1.0])).backward()
    out["hand_gain"] = hand.gain()
    if world == 2:
        out["accumulated"] = _accumulated_under_no_sync(rank)
    return _pack(out)


def _accumulated_under_no_sync(rank: int) -> tuple[object, list[float]]:
    """A fairseq/VISSL-style loop: DDP, two backward passes per step (the first under no_sync),
    momentum SGD and an LR schedule."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), num_gradients_to_accumulate=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    g, gains = torch.Generator().manual_seed(rank), []
    for _ in range(4):
        for micro in range(2):
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
            if micro == 0:
                with ddp.no_sync():
                    nn.functional.mse_loss(ddp(x), y).backward()
            else:
                nn.functional.mse_loss(ddp(x), y).backward()
        gains.append(opt.gain())
        opt.step()
        sched.step()
        opt.zero_grad()
    return opt.scale, gains


def test_accumulated_gains_are_fairscale_0_4_13s_to_the_last_bit() -> None:
    """0.4.13 sums the squared gradients in float32 and orders σ²'s arithmetic its own way; ours
    summed in float64 (gains off by ~1e-7 relative, weights by ~6e-8). The numbers are 0.4.13's,
    run on the same loop (world 2, torch 2.13 CPU); its scale stays the int it computed."""
    scale, gains = _launched(2)[0]["accumulated"]
    assert type(scale) is int and scale == 4
    assert gains == [3.664683020406227, 2.560957539814401, 2.545587327223284, 2.7270759783778766]


_LAUNCHED: dict[int, list] = {}


def _launched(world: int) -> list:
    """Every rank's :func:`_run` at ``world`` ranks (one launch per world size for the module)."""
    if world not in _LAUNCHED:
        _LAUNCHED[world] = [_unpack(r) for r in fairscale.launch(_run, devices=world)]
    return _LAUNCHED[world]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_match_single_process_accumulation(world: int) -> None:
    results = _launched(world)
    gains, params = _single_process(world)
    assert all(g > 1.0 for g in gains)  # the gain is active
    for r in results:
        for name in ("sgd", "oss"):
            assert r[name]["scale"] == world
            assert r[name]["gains"] == pytest.approx(gains, rel=1e-5)
            for key, v in params.items():
                torch.testing.assert_close(r[name]["params"][key], v, rtol=1e-5, atol=1e-5)
        # ḡ = [2, 1], ‖ḡ‖² = 5, mean ‖g_i‖² = 6; σ² = S/(S-1), μ² = 5 - σ²/S
        s = float(world)
        var = s / (s - 1)
        sqr = 5 - var / s
        assert r["hand_gain"] == pytest.approx((var + sqr) / (var / s + sqr))
