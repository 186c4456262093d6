"""``for p in model.parameters(): p.grad = None`` on the model given to ``fairscale.parallelize``, as
PyTorch's performance guide clears gradients: it clears the ParallelModule's gradients
(``fairscale.runtime.grad_none_guard``).

The model's own tensors get no gradients once parallelized, so the loop had cleared nothing the
ranks train, and in the plain loop every step's gradients were added to the earlier ones: a dp2
MLP's weights were 7e-2 away from one process's after 3 SGD steps, silently. Clearing before the
forward or between forward and backward, under DDP, ZeRO-2 and FSDP, now trains as one process;
clearing some of the parameters is refused.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from planner.plan import DataParallel, Mesh, Plan

STEPS = 3
KINDS = ("ddp", "zero2", "fsdp")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (8,), generator=g)


def _clear(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _loop(model: nn.Module, call, optimizer: torch.optim.Optimizer, late: bool) -> None:
    for step in range(STEPS):
        if not late:
            _clear(model)
        loss = call(*_batch(step))
        if late:
            _clear(model)  # after the forward, before the backward
        loss.backward()
        optimizer.step()


def _one_process() -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    _loop(model, lambda x, y: F.cross_entropy(model(x), y), optimizer, late=False)
    return model.state_dict()


def _rank(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for kind in KINDS:
        for late in (False, True):
            model = _model()
            pm = fairscale.parallelize(model, example_inputs=_batch(0), loss_fn=F.cross_entropy,
                                       plan=Plan(mesh=Mesh(dp=2), data_parallel=DataParallel(kind=kind)),
                                       optimizer=functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9))
            _loop(model, pm, pm.optimizer, late)
            out[f"{kind} late={late}"] = pm.state_dict()
            pm.close()
    model = _model()
    pm = fairscale.parallelize(model, example_inputs=_batch(0), loss_fn=F.cross_entropy, plan=Plan(mesh=Mesh(dp=2)))
    pm(*_batch(0)).backward()
    model[0].weight.grad = None
    try:
        pm(*_batch(1)).backward()
        out["some"] = "(not refused)"
    except RuntimeError as exc:
        out["some"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    return fairscale.launch(_rank, devices=2)


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_clearing_every_parameters_grad_clears_the_parallel_modules(runs, kind, late) -> None:
    want = _one_process()
    got = runs[0][f"{kind} late={late}"]
    for k, v in want.items():
        assert torch.allclose(got[k], v, rtol=0, atol=1e-12), (k, (got[k] - v).abs().max())


def test_clearing_some_parameters_grads_is_refused(runs) -> None:
    for out in runs:
        assert out["some"].startswith("p.grad = None was set on 1 of the 4 trainable parameters of the model passed to "
                                      "fairscale.parallelize (e.g. 0.weight)"), out["some"]
