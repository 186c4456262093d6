"""``model.zero_grad()`` on the model given to ``fairscale.parallelize``, as Hugging Face's Trainer
clears gradients after ``optimizer.step()``: it clears the ParallelModule's gradients.

The model's own tensors get no gradients once parallelized, so the call had cleared nothing the
ranks train, and in the plain loop every step's gradients were added to the earlier ones: a tiny
LM's weights were 2.8e-2 away from one process's after 4 AdamW steps under dp2, silently
(``fairscale.runtime.zero_grad_guard``). So does ``zero_grad()`` of a module holding the model; a
submodule's is refused.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from planner.plan import Mesh, Plan

STEPS = 3


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 16)

    def forward(self, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        return F.cross_entropy(self.head(h + self.block(h)).flatten(0, 1), y.flatten())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _LM().double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 16, (4, 4), generator=g), torch.randint(0, 16, (4, 4), generator=g)


def _trainer_loop(model: nn.Module, call, optimizer: torch.optim.Optimizer) -> None:
    model.zero_grad()
    for step in range(STEPS):
        call(*_batch(step)).backward()
        optimizer.step()
        model.zero_grad()


def _rank(rank: int, world: int, wrapped: bool = False) -> dict[str, torch.Tensor] | None:
    model = _model()
    pm = fairscale.parallelize(model, example_inputs=_batch(0), plan=Plan(mesh=Mesh(dp=2)),
                               optimizer=functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9))
    # a module holding the model (a wrapper beside a teacher) clears its gradients too: it had cleared
    # nothing the ranks train (weights 0.37 off one process's after 3 steps, silently)
    _trainer_loop(nn.ModuleDict({"student": model, "teacher": nn.Linear(2, 2)}) if wrapped else model, pm,
                  pm.optimizer)
    with pytest.raises(RuntimeError, match=r"Sequential.zero_grad\(\) was called on a submodule of a model passed "
                                           r"to fairscale.parallelize"):
        model.block.zero_grad()
    state = pm.state_dict()
    return state if rank == 0 else None


@pytest.mark.parametrize("wrapped", [False, True])
def test_model_zero_grad_clears_the_parallel_modules_gradients(wrapped: bool) -> None:
    got = fairscale.launch(functools.partial(_rank, wrapped=wrapped), devices=2)[0]
    model = _model()
    _trainer_loop(model, model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    for key, want in model.state_dict().items():
        assert torch.allclose(got[key], want, rtol=0, atol=1e-12), key
