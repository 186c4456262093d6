"""A training script written the way FairScale 0.4.13's documentation shows it runs unchanged.

The script below follows the "OSS + ShardedDDP" tutorial (``mp.spawn``, ``dist.init_process_group``,
``OSS(params=..., optim=..., **kwargs)``, ``ShardedDDP(model, optimizer)``, ``model.zero_grad()``)
and the Pipe tutorial (``Pipe(model, balance=..., chunks=...)``), with the only changes a CPU
machine forces: the ``gloo`` backend and no ``.to(rank)``. It runs as its own Python process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent('''
    import json
    import os
    import sys

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import torch.nn as nn

    from fairscale.nn.data_parallel import ShardedDataParallel as ShardedDDP
    from fairscale.optim.grad_scaler import ShardedGradScaler
    from fairscale.optim.oss import OSS
    from fairscale.nn import Pipe

    WORLD_SIZE = 2
    EPOCHS = 3


    def dist_init(rank, world_size):
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = sys.argv[2]
        dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)


    def myAwesomeModel():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


    def mySuperFastDataloader(rank):
        g = torch.Generator().manual_seed(rank)
        return [{"inputs": torch.randn(8, 16, generator=g), "label": torch.randint(0, 4, (8,), generator=g)}
                for _ in range(4)]


    def train(rank, world_size, epochs, out_dir):
        torch.set_num_threads(1)
        dist_init(rank, world_size)

        model = myAwesomeModel()
        dataloader = mySuperFastDataloader(rank)
        loss_fn = nn.CrossEntropyLoss()

        base_optimizer = torch.optim.SGD
        base_optimizer_arguments = {"lr": 1e-1, "momentum": 0.9}
        optimizer = OSS(params=model.parameters(), optim=base_optimizer, **base_optimizer_arguments)
        model = ShardedDDP(model, optimizer)
        scaler = ShardedGradScaler()

        model.train()
        losses = []
        for e in range(epochs):
            for batch in dataloader:
                model.zero_grad()
                outputs = model(batch["inputs"])
                loss = loss_fn(outputs, batch["label"])
                scaler.scale(loss).backward()
                norm = optimizer.clip_grad_norm(10.0)
                scaler.step(optimizer)
                scaler.update()
                losses.append(loss.item())

        optimizer.consolidate_state_dict()
        state = optimizer.state_dict() if rank == 0 else None
        params = [p.detach().sum().item() for p in model.parameters()]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"losses": losses, "params": params,
                       "state_entries": None if state is None else len(state["state"])}, f)
        dist.destroy_process_group()


    def pipe_example():
        a, b, c, d = nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4)
        model = nn.Sequential(a, b, c, d)
        reference = model(torch.ones(8, 16))
        model = Pipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=4)
        output = model(torch.ones(8, 16))
        output.sum().backward()
        return (output - reference).abs().max().item()


    if __name__ == "__main__":
        mp.spawn(train, args=(WORLD_SIZE, EPOCHS, sys.argv[1]), nprocs=WORLD_SIZE, join=True)
        with open(os.path.join(sys.argv[1], "pipe.json"), "w") as f:
            json.dump({"pipe_err": pipe_example()}, f)
''')


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


# Slow tier: in roughly 1 of 10 runs a spawned rank aborts at interpreter exit, after its results are
# written and its process group destroyed ("terminate called without an active exception", SIGABRT);
# the original FairScale 0.4.13 showed the same abort on torch 2.13 + gloo. Open: find the teardown
# race. Until then it would make the default tier fail at random; run it with -m slow.
@pytest.mark.slow
def test_documented_oss_sharded_ddp_and_pipe_script_runs(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), _free_port()], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert len(r["losses"]) == 12
        assert sum(r["losses"][-4:]) < sum(r["losses"][:4])  # it learns
    # the ranks hold identical parameters after sharded steps and broadcasts
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[0]["state_entries"] == 4  # momentum buffers of all 4 parameters, consolidated on rank 0
    assert json.loads((tmp_path / "pipe.json").read_text())["pipe_err"] < 1e-6
