"""Pipeline step time: fairscale's executor against torch.distributed.pipelining, and the bubble.

Both run in the same launch on CPU gloo ranks, on the same GPT (untied embeddings, since
torch.distributed.pipelining does not keep tied copies in sync), with the same split (the blocks
divided evenly over the stages, embeddings on the first, ln_f and lm_head on the last), the same
schedule and the same microbatches. Printed per schedule:

* step time (median over timed steps, between barriers) of each, and the ratio fairscale / torch
  (the goal is <= 1.0);
* the bubble: measured on fairscale's executor (1 - time in F/B / step time, mean over ranks), the
  planner's closed form ``(p-1)/(v·m+p-1)`` (``planner.schedule.predicted_bubble``), and the
  simulator's bubble for the measured per-stage F and B costs (what the planner would predict
  with perfect costs; the gap to the measured one is communication and overhead).

Run (the lead runs it on a quiet machine)::

    python benchmarks/pipeline/bench_pipeline.py --pp 4 --microbatches 8 --layers 8 --dim 256
    python benchmarks/pipeline/bench_pipeline.py --tiny      # seconds; checks that it runs
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as sp
from torch import nn

import fairscale.runtime as rt
from fairscale.runtime.mesh import build_mesh
from fairscale.runtime.pipeline import PipelineExecutor
from fairscale.testing.models import GPT, GPTConfig, lm_loss
from passes.ops import comm
from passes.split_stages import split_stages_pass
from planner.capture import capture
from planner.graph import ModelGraph
from planner.plan import Mesh, Plan, Schedule, Stage
from planner.schedule import build_schedule, predicted_bubble, simulate


def _split(layers: int, stages: int) -> list[range]:
    """Block indices of each stage: as even as possible, earlier stages get the remainder."""
    base, extra = divmod(layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def _selectors(blocks: list[range]) -> list[str]:
    out = []
    for s, r in enumerate(blocks):
        names = (["wte", "wpe"] if s == 0 else []) + [f"layers.{i}" for i in r]
        names += ["ln_f", "lm_head"] if s == len(blocks) - 1 else []
        out.append(", ".join(names))
    return out


class _TorchStage(nn.Module):
    """The same layers as our stage, as an eager module for torch.distributed.pipelining."""

    def __init__(self, model: GPT, blocks: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        self.layers = nn.ModuleList(model.layers[i] for i in blocks)
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.layers:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def _batch(cfg: GPTConfig, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, cfg.vocab, (n, cfg.seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _timed(fn: Any, steps: int, warmup: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        fn(i)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _rank(rank: int, world: int, args: argparse.Namespace, cfg: GPTConfig,
          graphs: dict[str, ModelGraph]) -> dict[str, Any]:
    mesh, _ = build_mesh(world, 1, 1)
    with mesh.groups.active():
        torch.set_num_threads(args.threads)
        out: dict[str, Any] = {}
        for kind in args.kinds:
            v = 2 if kind == "interleaved" else 1
            blocks = _split(cfg.layers, world * v)
            plan = Plan(mesh=Mesh(pp=world), schedule=Schedule(kind=kind, microbatches=args.microbatches,
                                                                virtual_stages=v),
                        stages=[Stage(layers=s) for s in _selectors(blocks)])
            graph = graphs[kind]
            sched = build_schedule(kind, pp=world, microbatches=args.microbatches, virtual_stages=v)
            pipe = PipelineExecutor(split_stages_pass(graph.gm, plan, graph=graph), sched, record=True)
            bubbles, costs = [], []

            def ours(i: int) -> None:
                for p in pipe.parameters():
                    p.grad = None
                pipe.step(_batch(cfg, i, args.batch))
                bubbles.append(pipe.trace.bubble)
                costs.append(list(pipe.trace.compute))

            ours_t = _timed(ours, args.steps, args.warmup)

            torch.manual_seed(0)
            model = GPT(cfg)
            mine = sched.rank_stages(rank)
            stages = [sp.PipelineStage(
                _TorchStage(model, blocks[s], first=s == 0, last=s == len(blocks) - 1), s, len(blocks),
                torch.device("cpu"), group=comm.get_group("pp")) for s in mine]
            if kind == "interleaved":
                schedule = sp.ScheduleInterleaved1F1B(stages, args.microbatches, loss_fn=lm_loss)
            else:
                cls = sp.ScheduleGPipe if kind == "gpipe" else sp.Schedule1F1B
                schedule = cls(stages[0], args.microbatches, loss_fn=lm_loss)

            def theirs(i: int) -> None:
                for st in stages:
                    st.submod.zero_grad(set_to_none=True)
                ids, labels = _batch(cfg, i, args.batch)
                if rank == 0:
                    schedule.step(ids)
                elif rank == world - 1:
                    schedule.step(target=labels, losses=[])
                else:
                    schedule.step()

            torch_t = _timed(theirs, args.steps, args.warmup)
            out[kind] = {"ours": ours_t, "torch": torch_t, "bubble": bubbles[args.warmup:],
                         "compute": costs[args.warmup:]}
        return out


def _stage_costs(per_rank: list[dict[str, Any]], kind: str, stages: int) -> tuple[list[float], list[float]]:
    """Mean F and B seconds per stage over the timed steps, from the executors' traces."""
    f: dict[int, list[float]] = {s: [] for s in range(stages)}
    b: dict[int, list[float]] = {s: [] for s in range(stages)}
    for res in per_rank:
        for step in res[kind]["compute"]:
            for token, t0, t1 in step:
                stage = int(token.split("@")[1])
                (f if token.startswith("F") else b)[stage].append(t1 - t0)
    return [statistics.mean(f[s]) for s in range(stages)], [statistics.mean(b[s]) for s in range(stages)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16, help="global batch (rows) per step")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--kinds", default="gpipe,1f1b,interleaved")
    ap.add_argument("--tiny", action="store_true", help="a seconds-long run that only checks everything works")
    args = ap.parse_args()
    if args.tiny:
        args.pp, args.microbatches, args.layers, args.dim, args.seq, args.vocab = 2, 4, 4, 32, 16, 64
        args.batch, args.steps, args.warmup = 8, 2, 1
    args.kinds = args.kinds.split(",")
    for kind in args.kinds:
        if kind not in ("gpipe", "1f1b", "interleaved"):
            raise SystemExit(f"--kinds {kind}: torch.distributed.pipelining has no matching schedule (its V "
                             "schedules split weight gradients); compare gpipe, 1f1b or interleaved")
    if args.batch % args.microbatches:
        raise SystemExit(f"--batch {args.batch} must divide by --microbatches {args.microbatches}")
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, heads=args.heads, dim=args.dim, tied=False)
    for kind in args.kinds:
        v = 2 if kind == "interleaved" else 1
        if args.layers < args.pp * v:
            raise SystemExit(f"{kind} needs at least pp × v = {args.pp * v} blocks; got --layers {args.layers}")
    torch.manual_seed(0)
    model = GPT(cfg)
    graph = capture(model, _batch(cfg, 0, args.batch // args.microbatches), loss_fn=lm_loss, annotate=False)
    graphs = {kind: graph for kind in args.kinds}
    per_rank = rt.launch(_rank, args.pp, args=(args, cfg, graphs), timeout_s=3600)

    print(f"GPT layers={args.layers} dim={args.dim} seq={args.seq} vocab={args.vocab}, batch {args.batch}, "
          f"pp={args.pp}, microbatches={args.microbatches}, {args.threads} thread(s)/rank, CPU gloo")
    print(f"{'schedule':<12}{'fairscale ms':>14}{'torch ms':>11}{'ratio':>8}{'bubble meas.':>14}"
          f"{'predicted':>11}{'sim(costs)':>12}")
    for kind in args.kinds:
        v = 2 if kind == "interleaved" else 1
        ours = statistics.median(max(r[kind]["ours"][i] for r in per_rank) for i in range(args.steps))
        theirs = statistics.median(max(r[kind]["torch"][i] for r in per_rank) for i in range(args.steps))
        measured = statistics.mean(b for r in per_rank for b in r[kind]["bubble"])
        predicted = predicted_bubble(kind, pp=args.pp, microbatches=args.microbatches, virtual_stages=v)
        f, b = _stage_costs(per_rank, kind, args.pp * v)
        sim = simulate(build_schedule(kind, pp=args.pp, microbatches=args.microbatches, virtual_stages=v),
                       f_cost=f, b_cost=b).bubble
        print(f"{kind:<12}{ours * 1e3:>14.1f}{theirs * 1e3:>11.1f}{ours / theirs:>8.2f}{measured:>14.3f}"
              f"{predicted:>11.3f}{sim:>12.3f}")


if __name__ == "__main__":
    main()
