"""Step time of fairscale's data-parallel kinds against native PyTorch and FairScale 0.4.13.

    python benchmarks/data_parallel/bench_dp.py                        # 2 and 4 ranks, ~4M GPT, fp32
    python benchmarks/data_parallel/bench_dp.py --tiny                 # seconds: checks it all runs
    python benchmarks/data_parallel/bench_dp.py --no-original          # skip FairScale 0.4.13
    python benchmarks/data_parallel/bench_dp.py --bucket-mb 4          # several buckets: overlap in backward

CPU, gloo, one intra-op thread per rank, fp32, the same seeded model and batches for everyone.
Each comparison pairs settings that do the same work:

    ours                                   native / original
    ddp  (bucket 25 MiB)                   torch DistributedDataParallel (bucket_cap_mb=25)
    fsdp (units layers.*, reshard, prefetch)  FSDP2 fully_shard per block + root (reshard_after_forward)
    zero1                                  FairScale 0.4.13 OSS + DDP (OSS broadcasts; we all-gather)
    zero2                                  FairScale 0.4.13 OSS + ShardedDataParallel

Each rank times ``warmup + steps`` full steps (zero_grad, forward, backward, optimizer step),
separated by barriers; a step's time is the slowest rank's; the table shows the median. Runs of
ours and theirs alternate ``--repeats`` times inside one invocation so machine noise hits both.
ratio = ours / theirs (goal ≤ 1.0; > 1.1 is a bug to fix or explain). Also printed: the bytes
our collectives moved per step on rank 0 (``passes.ops.comm.COUNTER``) against the ring theory.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fairscale  # noqa: E402
from fairscale.data_parallel import DataParallelRunner  # noqa: E402
from fairscale.runtime.data_parallel import local_slice  # noqa: E402
from gpt_model import batches, build  # noqa: E402
from passes.ops import comm  # noqa: E402
from planner.capture import LossModule, capture  # noqa: E402
from planner.plan import DataParallel  # noqa: E402

OURS = {
    "ddp": dict(kind="ddp", bucket_mb=25.0),
    "fsdp": dict(kind="fsdp", units="layers.*", reshard_after_forward=True, prefetch=True),
    "zero1": dict(kind="zero1", bucket_mb=25.0),
    "zero2": dict(kind="zero2", bucket_mb=25.0),
}
NATIVE = {"ddp": "torch DDP", "fsdp": "FSDP2 fully_shard"}
ORIGINAL = {"zero1": "oss_ddp", "zero2": "oss_sdp"}


def time_steps(step: Callable[[int], None], warmup: int, steps: int) -> list[float]:
    out = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        step(i)
        elapsed = time.perf_counter() - start
        if i >= warmup:
            out.append(elapsed)
    return out


def _native_step(model: torch.nn.Module, case: Any, data: list, rank: int, world: int) -> Callable[[int], None]:
    wrapped = LossModule(model, case.loss_fn)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        wrapped(*local_slice(data[i % len(data)], rank, world)).backward()
        opt.step()

    return step


def rank_main(rank: int, world: int, args: argparse.Namespace, graph: Any, case: Any, data: list) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    results: dict[str, Any] = {}
    for rep in range(args.repeats):
        for kind in args.kinds:
            cfg = dict(OURS[kind])
            if "bucket_mb" in cfg:
                cfg["bucket_mb"] = args.bucket_mb
            runner = DataParallelRunner.build(graph, DataParallel(**cfg), torch.optim.Adam, lr=1e-3)
            comm.COUNTER.reset()

            def ours(i: int) -> None:
                runner.train_step(data[i % len(data)])

            t = time_steps(ours, args.warmup, args.steps)
            steps_run = args.warmup + args.steps
            results.setdefault(f"ours:{kind}", []).extend(t)
            results[f"bytes:{kind}"] = comm.COUNTER.total_bytes() / steps_run
            del runner
            if kind == "ddp":
                model = copy.deepcopy(case.model)
                ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
                results.setdefault("native:ddp", []).extend(
                    time_steps(_native_step(ddp, case, data, rank, world), args.warmup, args.steps))
            elif kind == "fsdp":
                model = copy.deepcopy(case.model)
                mesh = init_device_mesh("cpu", (world,))
                for block in model.layers:
                    fully_shard(block, mesh=mesh, reshard_after_forward=True)
                fully_shard(model, mesh=mesh, reshard_after_forward=True)
                results.setdefault("native:fsdp", []).extend(
                    time_steps(_native_step(model, case, data, rank, world), args.warmup, args.steps))
    return results


def run_original(args: argparse.Namespace, world: int) -> dict[str, list[float]]:
    """FairScale 0.4.13 OSS + DDP / ShardedDataParallel, from its own venv (see README)."""
    python = Path(args.original_python)
    if not python.exists():
        return {"error": [f"{python} not found; create it as the README says, or pass --no-original"]}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [str(python), str(HERE / "original_worker.py"), "--world", str(world), "--size", args.size,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--repeats", str(args.repeats),
           "--global-batch", str(args.global_batch), "--bucket-mb", str(args.bucket_mb)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp", env=env)
    if r.returncode:
        return {"error": [r.stderr[-3000:]]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _slowest(per_rank: list[list[float]]) -> float:
    return statistics.median(max(ts) for ts in zip(*per_rank))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    p.add_argument("--kinds", nargs="+", default=list(OURS), choices=list(OURS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="gradient bucket cap (MiB) for ours (ddp, zero1, zero2) and torch DDP's bucket_cap_mb; "
                        "the 4M model is 17 MB, so the default 25 makes one bucket (torch DDP adds a 1 MiB first one)")
    p.add_argument("--tiny", action="store_true", help="tiny model and 2 steps: checks the script runs")
    p.add_argument("--no-original", action="store_true", help="skip FairScale 0.4.13")
    p.add_argument("--original-python", default="/tmp/fs013/bin/python")
    args = p.parse_args(argv)
    args.size = "tiny" if args.tiny else "4m"
    if args.tiny:
        args.steps, args.warmup, args.repeats = 2, 1, 1
    case = build(args.size)
    n_params = sum(t.numel() for t in case.model.parameters())
    print(f"GPT {args.size}: {n_params / 1e6:.2f}M parameters, fp32, global batch {args.global_batch}, "
          f"seq {case.model.cfg.seq}; CPU gloo, 1 thread per rank; median over {args.steps} steps x {args.repeats}")
    rows = []
    for world in args.devices:
        if args.global_batch % world:
            raise SystemExit(f"--global-batch {args.global_batch} does not divide over {world} ranks")
        data = batches(case, args.global_batch)
        graph = capture(case.model, local_slice(data[0], 0, world), loss_fn=case.loss_fn, annotate=False)
        per_rank = fairscale.launch(rank_main, devices=world, args=(args, graph, case, data))
        original = {} if args.no_original else run_original(args, world)
        model_bytes = n_params * 4
        for kind in args.kinds:
            ours = _slowest([r[f"ours:{kind}"] for r in per_rank])
            theirs_name, theirs = None, None
            if f"native:{kind}" in per_rank[0]:
                theirs_name, theirs = NATIVE[kind], _slowest([r[f"native:{kind}"] for r in per_rank])
            elif kind in ORIGINAL and ORIGINAL[kind] in original:
                theirs_name = f"FairScale 0.4.13 {ORIGINAL[kind].replace('_', '+').upper()}"
                theirs = _slowest(original[ORIGINAL[kind]])
            elif kind in ORIGINAL:
                theirs_name = "FairScale 0.4.13 (skipped)" if args.no_original else "FairScale 0.4.13 (failed)"
            mib = per_rank[0][f"bytes:{kind}"] / 2**20
            rows.append((world, kind, ours, theirs_name or "-", theirs, mib, model_bytes / 2**20))
        if "error" in original:
            print(f"note: FairScale 0.4.13 did not run at {world} ranks: {original['error'][0].strip()[-500:]}")
    print(f"\n{'ranks':>5} {'kind':<6} {'ours ms':>9}  {'baseline':<28} {'theirs ms':>9} {'ratio':>6} "
          f"{'MiB/step':>9} {'x model':>7}")
    for world, kind, ours, name, theirs, mib, model_mib in rows:
        ratio = f"{ours / theirs:6.2f}" if theirs else "     -"
        th = f"{theirs * 1e3:9.1f}" if theirs else "        -"
        print(f"{world:>5} {kind:<6} {ours * 1e3:9.1f}  {name:<28} {th} {ratio} {mib:9.2f} {mib / model_mib:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
