"""Tensor-parallel step time: the graph pass against DTensor ``parallelize_module``, same model, same run.

    python benchmarks/tensor_parallel/bench_tp.py --tp 2 --dim 512 --layers 4 --seq 256 --batch 8
    python benchmarks/tensor_parallel/bench_tp.py --tiny          # a few-second smoke run
    python benchmarks/tensor_parallel/bench_tp.py --bytes         # one step per variant: MiB only, per collective

Both sides shard the same Hugging Face Llama blocks the Megatron way (q/k/v, gate/up column-parallel;
o, down row-parallel; embedding and LM head replicated) on CPU gloo ranks, train with Adam and the
same batches. Printed per variant: median step time (slowest rank), the ratio ours/DTensor (goal
<= 1.0), and for ours the bytes each rank moved per step (``passes.ops.comm.COUNTER``, ring volume)
against the theoretical Megatron volume:

    blocks   L × 4 all-reduces of [b, t, d] (2 forward "g", 2 backward "f")
    per all-reduce of B bytes on n ranks: 2(n-1)/n · B   (Thakur et al. 2005)

Sequence parallelism replaces each all-reduce by an all-gather plus a reduce-scatter of the same
total volume (Korthikanti et al. 2022, table 1), plus one all-reduce of each norm weight's gradient
and one all-gather of the final hidden state for the replicated LM head. The replicated embedding's
output enters the sequence-sharded residual at no cost: it is copied once (the all-reduce of layer
0's block entry) and split locally, so its gradient needs no all-gather of its own
(``passes.tp.fuse.hoist_copy_over_scatter``; Megatron-LM's ``scatter_to_sequence_parallel_region``
would all-gather it, 0.5 MiB per step at the default sizes).
The "ours: detector plan" line adds what the pattern detector proposes (vocab-parallel embedding and
loss), whose extra volume is one [b, t, d] all-reduce forward (embedding), one backward (LM head
input), and the loss's all-reduces of [N] and [2, N].
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import fairscale
from fairscale.runtime.mesh import build_mesh
from fairscale.testing.models import build, lm_loss
from passes.ops import comm
from passes.tp.shard_tensor_parallel import shard_tensor_parallel_pass
from passes.tp.patterns import propose_tp_rules
from planner.capture import capture
from planner.plan import Mesh, Plan, TensorParallel

BLOCK_RULES = {"layers.*.self_attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.self_attn.o_proj": "rowwise",
               "layers.*.mlp.[gate_proj,up_proj]": "colwise", "layers.*.mlp.down_proj": "rowwise"}


def _variants(detector_rules: dict[str, str]) -> list[tuple[str, dict[str, str], bool]]:
    return [("ours", BLOCK_RULES, False), ("ours+sp", BLOCK_RULES, True),
            ("ours: detector plan", detector_rules, False)]


def _timed_steps(step: Any, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def _ours(gm: torch.fx.GraphModule, rules: dict[str, str], sp: bool, rank: int, tp: int, batch: tuple[Any, ...],
          steps: int, warmup: int) -> tuple[list[float], float, str]:
    plan = Plan(mesh=Mesh(tp=tp), tensor_parallel=TensorParallel(rules=rules, sequence_parallel=sp))
    local = shard_tensor_parallel_pass(copy.deepcopy(gm), plan, tp_index=rank, tp_size=tp)
    opt = torch.optim.Adam(local.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        local(*batch).backward()
        opt.step()

    times = _timed_steps(step, steps, warmup)
    comm.COUNTER.reset()
    step()
    return times, comm.COUNTER.total_bytes(), comm.COUNTER.summary()


def _dtensor(model: torch.nn.Module, mesh: Any, batch: tuple[Any, ...], steps: int, warmup: int) -> list[float]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = copy.deepcopy(model)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids, labels = batch

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        lm_loss(model(ids), labels).backward()
        opt.step()

    return _timed_steps(step, steps, warmup)


def _rank(rank: int, world: int, args: argparse.Namespace, gm: torch.fx.GraphModule, model: torch.nn.Module,
          detector_rules: dict[str, str], batch: tuple[Any, ...]) -> dict[str, Any]:
    mesh, device_mesh = build_mesh(1, 1, world)
    with mesh.groups.active():
        tp_mesh = device_mesh["tp"]
        out: dict[str, Any] = {}
        if args.bytes:
            for name, rules, sp in _variants(detector_rules):
                _, out[name + ":bytes"], out[name + ":summary"] = _ours(gm, rules, sp, rank, world, batch, 0, 0)
            return out
        # interleave the two sides so machine noise hits both alike
        for rep in range(args.repeats):
            out.setdefault("dtensor", []).extend(_dtensor(model, tp_mesh, batch, args.steps, args.warmup))
            for name, rules, sp in _variants(detector_rules):
                times, moved, _ = _ours(gm, rules, sp, rank, world, batch, args.steps, args.warmup)
                out.setdefault(name, []).extend(times)
                out[name + ":bytes"] = moved
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--tiny", action="store_true", help="smoke-test sizes")
    p.add_argument("--bytes", action="store_true", help="no timing: one step per variant, MiB per collective")
    args = p.parse_args()
    if args.tiny:
        args.dim, args.layers, args.heads, args.kv_heads, args.vocab = 64, 2, 4, 2, 128
        args.seq, args.batch, args.steps, args.warmup, args.repeats = 16, 2, 2, 1, 1
    case = build("llama", layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, dim=args.dim,
                 vocab=args.vocab, seq=args.seq)
    batch = case.make_batch(0, args.batch)
    graph = capture(case.model, batch, loss_fn=case.loss_fn)
    detector_rules = propose_tp_rules(graph.gm, tp=args.tp).rules
    res = fairscale.launch(_rank, devices=args.tp, args=(args, graph.gm, case.model, detector_rules, batch),
                           threads_per_rank=args.threads)

    def median(name: str) -> float:  # slowest rank per step, then the median over steps
        return statistics.median(max(r[name][i] for r in res) for i in range(len(res[0][name])))

    n, b, t, d, L = args.tp, args.batch, args.seq, args.dim, args.layers
    ar = 2 * (n - 1) / n
    act = b * t * d * 4
    theory_blocks = L * 4 * ar * act
    # SP: same block volume; the replicated LM head gathers the sequence-sharded final hidden state
    # once, and every norm weight's gradient is all-reduced (2 per layer + the final norm); the
    # embedding output's entry into the residual is free (see the module docstring)
    theory_sp = theory_blocks + (n - 1) / n * act + (2 * L + 1) * ar * d * 4
    theory_vocab = theory_blocks + 2 * ar * act + ar * (b * t * 4 + 2 * b * t * 4)
    if args.bytes:
        print(f"llama dim={d} layers={L} heads={args.heads}/{args.kv_heads} vocab={args.vocab} seq={t} batch={b} "
              f"tp={n}: bytes per step and rank (ring volumes)")
        for name, theory in (("ours", theory_blocks), ("ours+sp", theory_sp), ("ours: detector plan", theory_vocab)):
            moved = res[0][name + ":bytes"]
            print(f"\n{name}: {moved / 2**20:.3f} MiB moved, theory {theory / 2**20:.3f} MiB")
            print(res[0][name + ":summary"])
        return
    base = median("dtensor")
    print(f"llama dim={d} layers={L} heads={args.heads}/{args.kv_heads} vocab={args.vocab} seq={t} batch={b} "
          f"tp={n} (CPU gloo, {args.threads} thread/rank)")
    print(f"{'variant':<24}{'step ms':>10}{'vs DTensor':>12}{'MiB/step':>12}{'theory MiB':>12}")
    print(f"{'dtensor':<24}{base * 1e3:>10.1f}{1.0:>12.2f}{'-':>12}{theory_blocks / 2**20:>12.2f}")
    for name, theory in (("ours", theory_blocks), ("ours+sp", theory_sp), ("ours: detector plan", theory_vocab)):
        ms = median(name)
        moved = res[0][name + ":bytes"]
        print(f"{name:<24}{ms * 1e3:>10.1f}{ms / base:>12.2f}{moved / 2**20:>12.2f}{theory / 2**20:>12.2f}")


if __name__ == "__main__":
    main()
