"""A rank that is alive but stuck ends the job within the collective timeout (issue 15, item 1):
every group the mesh creates carries the world's timeout, and pipeline waits are bounded and say
what they waited for."""

from __future__ import annotations

import time

import pytest

import fairscale
from fairscale.runtime.launch import RankFailedError
from fairscale.testing.models import build

TIMEOUT_S = 20.0  # above group creation under a loaded machine (it rendezvous within the timeout too)


def _stuck(rank: int, world: int, stuck_rank: int) -> str:
    from fairscale.runtime.mesh import configured_timeout

    case = build("gpt")
    batch = case.make_batch(0, 8)
    pm = fairscale.parallelize(case.model, example_inputs=batch, loss_fn=case.loss_fn,
                               constraints={"mesh": {"pp": 2, "dp": 2, "tp": 2}})
    assert (pm.plan.mesh.pp, pm.plan.mesh.dp, pm.plan.mesh.tp) == (2, 2, 2)
    assert configured_timeout().total_seconds() == TIMEOUT_S
    pm.train_step(batch)
    if rank == stuck_rank:
        time.sleep(3600)  # alive, holding no lock, never reaching the next collective
    pm.train_step(batch)
    return "finished"


@pytest.mark.parametrize("stuck_rank", [0, pytest.param(5, marks=pytest.mark.slow)])
def test_a_stuck_rank_fails_the_job_within_the_timeout(stuck_rank: int) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        fairscale.launch(_stuck, devices=8, args=(stuck_rank,), collective_timeout_s=TIMEOUT_S)
    took = time.monotonic() - start
    text = str(info.value)
    first = text.split("--- rank ")[1]  # the root cause: the rank that failed first
    assert "pm.train_step(batch)" in first and "parallelize(" not in first, text[:3000]  # in the step, not setup
    assert "timed out" in first.lower() or "waited 20 s (the collective timeout)" in first, first[:3000]
    assert took < 90 + TIMEOUT_S + 10, took  # start-up and the first step, then the timeout and the grace
