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


# Observer only: each Python process of the run (the script, its spawned ranks) records at exit
# which threads are still alive, so the test can check that no gloo worker runs on into interpreter
# finalization. It changes no behaviour of the script.
SITECUSTOMIZE = textwrap.dedent('''
    import atexit, json, os, sys

    def _record_threads_at_exit():
        import multiprocessing
        names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
        with open(os.path.join(os.environ["FS_TEST_EXIT_THREADS"], f"threads-{os.getpid()}.json"), "w") as f:
            json.dump({"threads": names, "spawned_rank": multiprocessing.parent_process() is not None
                       and "torch.distributed" in sys.modules}, f)

    atexit.register(_record_threads_at_exit)  # registered first, so it runs last: just before finalization
''')

# Threads that a live gloo process group runs (worker loop, transport loop, TCPStore server).
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("legacy_oss_sdp_pipe")
    (out / "site").mkdir()
    (out / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (out / "threads").mkdir()
    script = out / "train.py"
    script.write_text(SCRIPT)
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS="1", FS_TEST_EXIT_THREADS=str(out / "threads"))
    env["PYTHONPATH"] = os.pathsep.join([str(out / "site"), root, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), str(out), _free_port()], env=env,
                          capture_output=True, text=True, timeout=300)
    return proc, out


# Why a rank could abort at exit, after its results were written ("terminate called without an
# active exception", SIGABRT; about 1 run in 10, far more often on a loaded machine): a gloo worker
# thread frees a finished collective's Work after the waiter has returned; freeing its tensors
# decrefs their Python objects, which takes the GIL (c10::TensorImpl::decref_pyobject ->
# gil_scoped_acquire). If the interpreter has begun finalizing by then, CPython ends the thread with
# pthread_exit inside that noexcept destructor, and the forced unwind calls std::terminate. It can
# only happen while the process group outlives destroy_process_group (plain torch frees it there and
# joins its workers). Three references kept the world group alive here: torch.distributed.nn's
# ``group=group.WORLD`` default arguments, bound when torch imports that module lazily after
# init_process_group (fixed in fairscale/optim/oss.py), passes.ops.comm's strong axis->group table, and
# ShardedDataParallel's gradient hooks (a reference cycle through C++ hook storage that gc cannot
# collect). Both now hold weak references, so the group dies in destroy_process_group and its
# threads are joined there; test_no_gloo_thread_runs_into_interpreter_exit checks exactly that.
def test_documented_oss_sharded_ddp_and_pipe_script_runs(run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = run
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert len(r["losses"]) == 12
        assert sum(r["losses"][-4:]) < sum(r["losses"][:4])  # it learns
    # the ranks hold identical parameters after sharded steps and broadcasts
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[0]["state_entries"] == 4  # momentum buffers of all 4 parameters, consolidated on rank 0
    assert json.loads((out / "pipe.json").read_text())["pipe_err"] < 1e-6


def test_no_gloo_thread_runs_into_interpreter_exit(run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _, out = run
    records = [json.loads(f.read_text()) for f in sorted((out / "threads").glob("threads-*.json"))]
    ranks = [r for r in records if r["spawned_rank"]]
    assert len(ranks) == 2, records
    alive = [sorted(set(r["threads"]) & set(GLOO_THREADS)) for r in ranks]
    assert alive == [[], []], f"gloo threads still running at interpreter exit, per rank: {alive}"
