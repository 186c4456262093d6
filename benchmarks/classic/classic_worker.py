"""One timed run of a FairScale classic component; imports only FairScale's public API, so the
same file runs against this repository or against the original FairScale 0.4.13 (whichever
``fairscale`` the interpreter finds). Prints one JSON line: the per-step seconds of rank 0..n-1.

    python classic_worker.py --component oss|sdp|pipe --world 2 --steps 20 --warmup 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _model(dim: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(dim, dim), nn.ReLU()]
    mods.append(nn.Linear(dim, 8))
    return nn.Sequential(*mods)


def _batches(args: argparse.Namespace, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(args.batch, args.dim, generator=g), torch.randint(0, 8, (args.batch,), generator=g))
            for _ in range(4)]


def _time_steps(step, batches, args) -> list[float]:
    out = []
    for i in range(args.warmup + args.steps):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        step(*batches[i % len(batches)])
        out.append(time.perf_counter() - t0)
    return out[args.warmup:]


def _rank(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    from fairscale.optim import OSS

    model = _model(args.dim, args.layers)
    loss_fn = nn.CrossEntropyLoss()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)
    if args.component == "sdp":
        from fairscale.nn.data_parallel import ShardedDataParallel

        wrapped: nn.Module = ShardedDataParallel(model, opt)
    else:  # OSS under plain DDP, as FairScale's OSS tutorial pairs them
        wrapped = nn.parallel.DistributedDataParallel(model)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(wrapped(x), y).backward()
        opt.step()

    times = _time_steps(step, _batches(args, rank), args)
    queue.put((rank, times))
    dist.barrier()
    dist.destroy_process_group()


def _pipe(args: argparse.Namespace) -> list[float]:
    torch.set_num_threads(args.threads)
    from fairscale.nn import Pipe

    model = _model(args.dim, args.layers)
    n = len(model)
    balance = [n // 2, n - n // 2]
    pipe = Pipe(model, balance=balance, devices=["cpu", "cpu"], chunks=args.chunks, checkpoint="except_last")
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(pipe(x), y).backward()
        opt.step()

    return _time_steps(step, _batches(args, 0), args)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--component", choices=("oss", "sdp", "pipe"), required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--port", type=int, default=29500)
    args = p.parse_args()
    import fairscale

    if args.component == "pipe":
        per_rank = [_pipe(args)]
    else:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        procs = [ctx.Process(target=_rank, args=(r, args, args.port, queue)) for r in range(args.world)]
        for pr in procs:
            pr.start()
        got = dict(queue.get() for _ in procs)
        for pr in procs:
            pr.join()
        per_rank = [got[r] for r in range(args.world)]
    print(json.dumps({"fairscale": fairscale.__version__, "file": fairscale.__file__, "per_rank": per_rank}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
