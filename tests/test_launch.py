"""The launcher: results per rank, failures reported fast and with the root cause first."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import fairscale
from passes.ops import comm


def _collectives(rank, world):
    comm.set_group("dp", dist.group.WORLD)
    comm.COUNTER.reset()
    x = torch.full((4,), float(rank), requires_grad=True)
    (comm.copy_to_group(x, "dp") * (rank + 1)).sum().backward()
    z = comm.gather_from_group(torch.tensor([[float(rank)]]), "dp", dim=1)
    return x.grad.tolist(), z.tolist(), comm.COUNTER.snapshot()


def test_launch_returns_each_rank_result_and_counts_bytes():
    results = fairscale.launch(_collectives, devices=4)
    for grad, gathered, counts in results:
        assert grad == [10.0] * 4  # sum over ranks of (rank + 1)
        assert gathered == [[0.0, 1.0, 2.0, 3.0]]
        # ring volumes: all-reduce 2(n-1)/n * 16 B, all-gather (n-1)/n * 16 B
        assert counts["all_reduce:dp"] == {"bytes": 24.0, "payload": 16, "calls": 1}
        assert counts["all_gather:dp"] == {"bytes": 12.0, "payload": 16, "calls": 1}


def _raise_on_2(rank, world):
    if rank == 2:
        raise ValueError("boom on rank 2")
    dist.barrier()


def _die_on_1(rank, world):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def test_a_raising_rank_stops_the_others_quickly():
    start = time.monotonic()
    with pytest.raises(fairscale.RankFailedError, match=r"rank 2 failed first") as info:
        fairscale.launch(_raise_on_2, devices=4, grace_s=5)
    assert "ValueError: boom on rank 2" in str(info.value)
    assert time.monotonic() - start < 15


def test_a_dying_rank_is_named_with_its_exit_code():
    with pytest.raises(fairscale.RankFailedError, match=r"rank 1 failed first") as info:
        fairscale.launch(_die_on_1, devices=4, grace_s=5)
    assert "process exited with code 3 without reporting a result" in str(info.value)


def _tensors(rank, world):
    return {"w": torch.full((3,), float(rank))}


def test_tensors_come_back_by_value_after_the_rank_exits():
    results = fairscale.launch(_tensors, devices=2)
    assert [r["w"].tolist() for r in results] == [[0.0] * 3, [1.0] * 3]
