"""A ``ParallelModule`` method every rank must call together, called on one rank only.

nanoGPT's train.py checkpoints under ``if master_process:``; ported as ``torch.save({'model':
pm.state_dict()})`` there, rank 0 gathered the tensor-parallel slices alone while rank 1 went on to
its next step, and both gave up with gloo's bare 'Timed out waiting 10000ms for send operation to
complete', rank 0's error naming nothing of fairscale's and rank 1's naming rank 0 as 'in no
collective'. Such methods are now calls in the flight record (``fairscale.runtime.watchdog.
collective_call``): each rank's error says where the other is, and a user's mistake inside one (a
missing checkpoint) is left as it is.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.runtime.watchdog import CollectiveError
from planner.plan import Mesh, Plan, TensorParallel


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.down(F.gelu(self.up(x))), y)


def _rank(rank: int, world: int, missing: str) -> None:
    torch.manual_seed(0)
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    plan = Plan(mesh=Mesh(tp=2), tensor_parallel=TensorParallel(rules={"up": "colwise", "down": "rowwise"}))
    pm = fairscale.parallelize(_MLP(), example_inputs=batch, plan=plan,
                               optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(FileNotFoundError) as info:  # the user's mistake, not a communication failure
        pm.load_checkpoint(missing)
    assert not isinstance(info.value, CollectiveError)
    pm.train_step(batch)
    if rank == 0:
        pm.state_dict()  # as under nanoGPT's `if master_process:`
    pm.train_step(batch)


def test_a_collective_method_called_on_one_rank_is_named_in_every_ranks_error(tmp_path) -> None:
    with pytest.raises(fairscale.RankFailedError) as info:
        fairscale.launch(_rank, devices=2, args=(str(tmp_path / "none"),), collective_timeout_s=3.0, grace_s=3)
    failures = info.value.failures
    zero = failures[0]
    # rank 0 times out itself ("gave up"), or first sees rank 1, which timed out, close the connection ("failed")
    assert ("gave up after waiting" in zero or "failed after waiting" in zero) \
        and "(collective_timeout_s = 3) for world call #" in zero, zero
    assert "(pm.state_dict(), which every rank must call together, step 0" in zero, zero
    assert "rank 1 (pp 0, dp 0, tp 1)" in zero and "tp all_reduce" in zero and "step 1, F0@0" in zero, zero
    assert "pm.load_checkpoint(path), which every rank must call together): done" in zero, zero
    if 1 in failures:  # rank 1 may be stopped before it reports
        assert "pm.state_dict(), which every rank must call together" in failures[1], failures[1]
