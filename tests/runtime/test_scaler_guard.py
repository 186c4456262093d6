"""``torch.amp.GradScaler`` driving ``pm.optimizer`` (``fairscale.runtime.scaler_guard``).

Under ZeRO-2 and FSDP the scaler found no gradients in ``pm.optimizer.param_groups`` and
``scaler.step(pm.optimizer)`` failed after launch ("No inf checks were recorded for this
optimizer"); under tensor parallelism an inf in one rank's slice made that rank alone skip its step.
Now the gradients pm steps are unscaled and infs are found over every rank, so the ranks train as
one process does (float64, SGD with momentum and weight decay groups) and skip a step together.
"""

from __future__ import annotations

import pytest
import torch

import fairscale
from fairscale.testing.models import build
from fairscale.testing.plans import even_plan
from planner.plan import Plan

STEPS, BATCH = 3, 8


def _case():
    case = build("gpt")
    case.model.double()
    return case


def _sgd(model) -> torch.optim.Optimizer:
    params = list(model.parameters())
    return torch.optim.SGD([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                            {"params": [p for p in params if p.dim() < 2]}], lr=0.1, momentum=0.9)


def _plan(kind: str, dp: int, tp: int) -> Plan:
    return even_plan(_case(), BATCH, 1, dp, tp, kind)


def _rank(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for kind in ("zero2", "fsdp"):
        case = _case()
        pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                                   plan=_plan(kind, 2, 1), optimizer=_sgd(case.model))
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(STEPS):
            scaler.scale(pm(*case.make_batch(step, BATCH))).backward()
            scaler.unscale_(pm.optimizer)
            torch.nn.utils.clip_grad_norm_(case.model.parameters(), 1e9)  # reads the unscaled gradients
            scaler.step(pm.optimizer)
            scaler.update()
            pm.optimizer.zero_grad()
        out[kind] = pm.state_dict()
        pm.close()

    case = _case()
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                               plan=_plan("ddp", 1, 2), optimizer=_sgd(case.model))
    before = pm.state_dict()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(pm(*case.make_batch(0, BATCH))).backward()
    if rank == 1:  # an overflow in one tensor-parallel slice only
        sliced = max(pm.parameters(), key=lambda p: p.numel())
        sliced.grad.view(-1)[0] = float("inf")
    scaler.step(pm.optimizer)
    scaler.update()
    after = pm.state_dict()
    out["skipped"] = (scaler.get_scale(), all(torch.equal(after[k], v) for k, v in before.items()))
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    return fairscale.launch(_rank, devices=2, timeout_s=600)


def test_scaled_training_under_sharded_kinds_is_one_process_training(runs) -> None:
    case = _case()
    opt = _sgd(case.model)
    for step in range(STEPS):
        x, y = case.make_batch(step, BATCH)
        case.loss_fn(case.model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for kind in ("zero2", "fsdp"):
        got = runs[0][kind]
        for key, value in case.model.state_dict().items():
            assert torch.allclose(got[key], value, rtol=1e-10, atol=1e-12), (kind, key)


def test_an_inf_on_one_rank_skips_the_step_on_every_rank(runs) -> None:
    for out in runs:
        scale, unchanged = out["skipped"]
        assert scale == 512.0 and unchanged, out["skipped"]
