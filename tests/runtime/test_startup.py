"""Build-time rendezvous (fairscale.runtime.startup): a rank slow at its own build-time work
(capture, the compile check) no longer ends the job with a collective timeout.

Before: the first collective after capture waited for the slowest rank under the collective
watchdog's timeout, meant for stuck steps; a rank whose capture took longer (a big export on a
loaded machine: the corpus run at load 50) crashed every rank after launch.
"""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch
from torch import nn

import fairscale
from fairscale.runtime.launch import RankFailedError
from fairscale.runtime.startup import StartupTimeoutError, rendezvous
from planner.plan import Mesh, Plan, Schedule

SLOW_S, COLLECTIVE_TIMEOUT_S = 4.0, 2.0


class SlowToCapture(nn.Module):
    """Rank 1 takes SLOW_S longer every time the model's Python forward runs (capture does)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if os.environ.get("RANK") == "1":
            time.sleep(SLOW_S)
        return ((self.b(torch.tanh(self.a(x))) - y) ** 2).mean()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _train(rank: int, world: int) -> list[float]:
    torch.manual_seed(0)
    pm = fairscale.parallelize(SlowToCapture(), example_inputs=_batch(0),
                               plan=Plan(mesh=Mesh(dp=2), schedule=Schedule(kind="1f1b", microbatches=1)),
                               optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    return [pm.train_step(_batch(step)) for step in range(2)]


def test_a_rank_slower_to_capture_than_the_collective_timeout_still_trains() -> None:
    losses = fairscale.launch(_train, devices=2, collective_timeout_s=COLLECTIVE_TIMEOUT_S)[0]
    torch.manual_seed(0)
    model = SlowToCapture()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, got in enumerate(losses):
        loss = model(*_batch(step))
        assert abs(got - loss.item()) < 1e-6, (losses, step)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _absent(rank: int, world: int) -> None:
    if rank == 0:
        rendezvous("capturing the model", timeout_s=1.0)
    else:
        time.sleep(4.0)  # never arrives within rank 0's deadline


def test_a_rank_that_never_arrives_is_named_at_the_startup_deadline() -> None:
    with pytest.raises(RankFailedError) as info:
        fairscale.launch(_absent, devices=2)
    text = str(info.value)
    assert StartupTimeoutError.__name__ in text, text
    assert "waited 1 s for rank(s) [1] to finish capturing the model" in text, text
    assert "FAIRSCALE_STARTUP_TIMEOUT_S" in text, text


def test_the_startup_deadline_is_checked() -> None:
    with pytest.raises(ValueError, match="startup_timeout_s must be positive"):
        fairscale.launch(_absent, devices=2, startup_timeout_s=0)
