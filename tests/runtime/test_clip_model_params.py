"""``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` after ``fairscale.parallelize``,
as nanoGPT and most training loops write it, clips by the global norm of the parallel gradients.

The model's own tensors get no gradients once parallelized (each rank trains its slices and
shards), so torch's function had returned 0 and clipped nothing: training went on unclipped, with
no error. ``fairscale.runtime.clip_guard`` now routes the model's parameters (frozen ones may be
left out) to ``pm.clip_grad_norm_``, and refuses some of them. SGD with momentum in float64, a clip
far below every step's norm, so a missed clip shows in the losses.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fairscale
from fairscale.testing.models import build
from fairscale.testing.reference import Trajectory, compare, train_reference
from planner.plan import DataParallel, Mesh, Plan, Schedule

STEPS, BATCH, CLIP = 3, 8, 0.05
PLAN = Plan(mesh=Mesh(dp=2), schedule=Schedule(kind="1f1b", microbatches=1, global_batch=BATCH),
            data_parallel=DataParallel(kind="zero2"))


def _case():
    case = build("gpt")
    case.model.double()
    return case


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _rank(rank: int, world: int) -> dict[str, object]:
    case = _case()
    model = case.model
    pm = fairscale.parallelize(model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=PLAN,
                               optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    got = Trajectory()
    for step in range(STEPS):
        pm.optimizer.zero_grad()
        loss = pm(*case.make_batch(step, BATCH))
        loss.backward()
        got.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        pm.optimizer.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        got.losses.append(float(mean) / world)
    try:
        torch.nn.utils.clip_grad_norm_(list(model.parameters())[:3], CLIP)
        partial = "(not refused)"
    except RuntimeError as exc:
        partial = str(exc)
    got.params = pm.state_dict()
    return {"trajectory": got, "partial": partial}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    return fairscale.launch(_rank, devices=2, timeout_s=600)


def test_clipping_the_models_parameters_clips_by_the_global_norm(runs) -> None:
    ref = train_reference(_case, steps=STEPS, global_batch=BATCH, clip_norm=CLIP, optimizer=_sgd)
    assert min(ref.grad_norms) > 10 * CLIP, ref.grad_norms  # every step clips
    for out in runs:
        got = out["trajectory"]
        assert got.grad_norms == pytest.approx(ref.grad_norms, rel=1e-10)
    compare(ref, runs[0]["trajectory"], rtol=1e-10, atol=1e-9)


def test_clipping_some_of_the_models_parameters_is_refused(runs) -> None:
    for out in runs:
        assert out["partial"].startswith("torch.nn.utils.clip_grad_norm_ was given some of the parameters of a "
                                         "model passed to fairscale.parallelize: "), out["partial"]
        assert "pm.clip_grad_norm_(max_norm)" in out["partial"], out["partial"]
