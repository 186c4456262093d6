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


TORCHRUN_SCRIPT = """
import json, sys
import torch
import fairscale
from fairscale.testing.models import build

case = build("mlp")
pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, 4), loss_fn=case.loss_fn)
losses = [pm.train_step(case.make_batch(step, 4)) for step in range(2)]
json.dump(dict(losses=losses, world=torch.distributed.get_world_size()), open(sys.argv[1], "w"))
"""


def test_parallelize_under_torchrun_initializes_the_process_group(tmp_path):
    """torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_* and initializes nothing: a script that
    calls parallelize directly (as under `fairscale run`) had raised "call it inside ... or torchrun"."""
    import json
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out.json")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["world"] == 1 and len(out["losses"]) == 2
