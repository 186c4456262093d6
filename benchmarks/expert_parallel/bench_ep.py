"""Expert parallelism: Mixtral trained data-parallel with its experts split over ep ranks, against torch DDP.

    python benchmarks/expert_parallel/bench_ep.py                 # dp=4, ep in 1, 2, 4
    python benchmarks/expert_parallel/bench_ep.py --tiny          # a few-second smoke run

Every variant trains the same Hugging Face Mixtral (float32, Adam) on the same batches on CPU gloo
ranks. The baseline is native ``torch.nn.parallel.DistributedDataParallel`` with every expert on
every rank. Ours runs ``fairscale.parallelize`` with ``mesh.dp = n`` and ``mesh.ep`` = 1 (plain
DDP plan), 2, ..., n. Printed per variant: median step time (slowest rank) and its ratio to torch
DDP, the expert parameters each rank holds, and the bytes each rank moved per step in the MoE
all-to-alls (``passes.ops.comm.COUNTER``) against the volume of uniform routing:

    per MoE layer and step: dispatch + combine forward, both again backward
    = 4 × (tokens per rank × top_k) × hidden × 4 bytes × (ep - 1)/ep

Real routing is not uniform, so the measured bytes differ from that estimate by the routing's
imbalance; tests/runtime/test_expert_parallel.py checks the counter against the actual routing
exactly. The expert gradients' all-reduce over the dp/ep ranks holding the same experts is printed
too (ring volume 2(n-1)/n of the rank's expert bytes).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import fairscale
from fairscale.api import captured, parallelize
from fairscale.testing.models import build
from passes.ops import comm
from planner.plan import Mesh, Plan, Schedule


def _model(args: argparse.Namespace) -> Any:
    return build("mixtral", layers=args.layers, dim=args.dim, heads=8, kv_heads=4, vocab=args.vocab, seq=args.seq,
                 experts=args.experts)


def _timed(step: Any, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def _torch_ddp(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    from fairscale.testing.reference import LossModule

    case = _model(args)
    model = torch.nn.parallel.DistributedDataParallel(LossModule(case.model, case.loss_fn))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    per = args.batch // world
    state = {"step": 0}

    def step() -> None:
        batch = case.make_batch(state["step"], args.batch)
        state["step"] += 1
        opt.zero_grad(set_to_none=True)
        model(*(t[rank * per:(rank + 1) * per] for t in batch)).backward()
        opt.step()

    times = _timed(step, args.steps, args.warmup)
    experts = sum(p.numel() for n, p in case.model.named_parameters() if ".experts." in n)
    return {"times": times, "experts": experts, "a2a": 0.0, "rep": 0.0}


def _ours(args: argparse.Namespace, rank: int, world: int, ep: int) -> dict[str, Any]:
    case = _model(args)
    plan = Plan(mesh=Mesh(dp=world, ep=ep), schedule=Schedule(global_batch=args.batch))
    pm = parallelize(case.model, example_inputs=case.make_batch(0, args.batch), loss_fn=case.loss_fn, plan=plan,
                     optimizer=functools.partial(torch.optim.Adam, lr=1e-4))
    state = {"step": 0}

    def step() -> None:
        pm.train_step(case.make_batch(state["step"], args.batch))
        state["step"] += 1

    for _ in range(args.warmup):
        step()
    comm.COUNTER.reset()
    step()
    counted = comm.COUNTER.snapshot()
    times = _timed(step, args.steps, 0)
    experts = sum(p.numel() for gm in pm.modules.values() for n, p in gm.named_parameters() if "experts" in n)
    return {"times": times, "experts": experts, "a2a": counted.get("all_to_all:ep", {}).get("bytes", 0.0),
            "rep": counted.get("all_reduce:ep_rep", {}).get("bytes", 0.0)}


def _run(rank: int, world: int, args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    torch.set_num_threads(1)
    out = [("torch DDP (experts replicated)", _torch_ddp(args, rank, world))]
    ep = 1
    while ep <= world:
        out.append((f"ours dp={world} ep={ep}", _ours(args, rank, world, ep)))
        ep *= 2
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="a few-second smoke run")
    args = ap.parse_args()
    if args.tiny:
        args.ranks, args.layers, args.dim, args.experts, args.vocab, args.seq = 2, 2, 64, 4, 128, 16
        args.batch, args.steps, args.warmup = 4, 4, 2
    case = _model(args)
    captured(case.model, case.make_batch(0, args.batch), loss_fn=case.loss_fn)  # once, before the fork
    results = fairscale.launch(_run, devices=args.ranks, args=(args,), timeout_s=1800)[0]
    tokens = args.batch // args.ranks * args.seq
    print(f"mixtral dim={args.dim} layers={args.layers} experts={args.experts} top_k=2 seq={args.seq} "
          f"batch={args.batch} on {args.ranks} CPU gloo ranks (1 thread each)")
    print(f"{'variant':<32}{'step ms':>9}{'vs DDP':>8}{'experts/rank':>14}{'a2a MiB':>9}{'uniform':>9}"
          f"{'ep_rep MiB':>12}")
    base = statistics.median(results[0][1]["times"])
    for name, r in results:
        t = statistics.median(r["times"])
        ep = int(name.rsplit("=", 1)[1]) if "ep=" in name else 1
        uniform = 4 * args.layers * tokens * 2 * args.dim * 4 * (ep - 1) / ep
        print(f"{name:<32}{t * 1e3:>9.1f}{t / base:>8.2f}{r['experts']:>14,}{r['a2a'] / 2**20:>9.2f}"
              f"{uniform / 2**20:>9.2f}{r['rep'] / 2**20:>12.2f}")


if __name__ == "__main__":
    main()
