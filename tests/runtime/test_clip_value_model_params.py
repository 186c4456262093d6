"""``torch.nn.utils.clip_grad_value_(model.parameters(), v)`` after ``fairscale.parallelize``, as
loops clip by value, clips the ParallelModule's gradients (``fairscale.runtime.clip_guard``).

The model's own tensors get no gradients once parallelized, so torch's function crashed on every
rank after launch inside its foreach kernels ('Expected !nested_tensorlist[0].empty() to be true,
but got false'). Clipping by value is elementwise, so clipping this rank's slices and shards is
exact; some of the model's parameters are refused, as for ``clip_grad_norm_``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from planner.plan import DataParallel, Mesh, Plan

STEPS, CLIP = 3, 1e-3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (4,), generator=g)


def _train(model: nn.Module, call, optimizer: torch.optim.Optimizer) -> None:
    for step in range(STEPS):
        call(*_batch(step)).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()


def _rank(rank: int, world: int) -> tuple[dict[str, torch.Tensor] | None, str]:
    model = _model()
    pm = fairscale.parallelize(model, example_inputs=_batch(0), loss_fn=F.cross_entropy,
                               plan=Plan(mesh=Mesh(dp=2), data_parallel=DataParallel(kind="zero2")),
                               optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    _train(model, lambda x, y: pm(x, y), pm.optimizer)
    try:
        torch.nn.utils.clip_grad_value_(list(model.parameters())[:2], CLIP)
        partial = "(not refused)"
    except RuntimeError as exc:
        partial = str(exc)
    state = pm.state_dict()
    return (state if rank == 0 else None), partial


def test_clipping_the_models_parameters_by_value_clips_the_parallel_gradients() -> None:
    results = fairscale.launch(_rank, devices=2)
    model = _model()
    _train(model, lambda x, y: F.cross_entropy(model(x), y), torch.optim.SGD(model.parameters(), lr=1.0))
    for key, want in model.state_dict().items():
        assert torch.allclose(results[0][0][key], want, rtol=0, atol=1e-12), key
    for _, partial in results:
        assert partial.startswith("torch.nn.utils.clip_grad_value_ was given some of the parameters of a model "
                                  "passed to fairscale.parallelize: "), partial
