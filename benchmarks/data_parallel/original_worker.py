"""FairScale 0.4.13's OSS + DDP (ZeRO-1) and OSS + ShardedDataParallel (ZeRO-2) on the benchmark
GPT; run by ``bench_dp.py`` with the interpreter of a venv where ``fairscale`` is 0.4.13.
Prints one JSON line: {"oss_ddp": [[step seconds of rank 0], ...], "oss_sdp": [...]}."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt_model import batches, build  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import fairscale
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim.oss import OSS
    from torch.nn.parallel import DistributedDataParallel

    assert fairscale.__version__ == "0.4.13", fairscale.__version__
    case = build(args.size)
    data = batches(case, args.global_batch)
    per = args.global_batch // world
    out: dict[str, list[float]] = {"oss_ddp": [], "oss_sdp": []}
    for _ in range(args.repeats):
        for name in out:
            model = build(args.size).model
            opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)
            wrapped = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb) if name == "oss_ddp" \
                else ShardedDataParallel(model, opt)
            for i in range(args.warmup + args.steps):
                x, y = (t[rank * per:(rank + 1) * per] for t in data[i % len(data)])
                dist.barrier()
                start = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                case.loss_fn(wrapped(x), y).backward()
                opt.step()
                if i >= args.warmup:
                    out[name].append(time.perf_counter() - start)
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--size", default="4m")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    args = p.parse_args()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=3600) for _ in procs)
    for proc in procs:
        proc.join()
    merged = {name: [results[r][name] for r in range(args.world)] for name in ("oss_ddp", "oss_sdp")}
    print(json.dumps(merged))


if __name__ == "__main__":
    main()
