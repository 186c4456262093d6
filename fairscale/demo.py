"""``python -m fairscale demo``: plan a small GPT for 8 CPU ranks, show the plan, train, check.

What it does, in order:

1. builds a nanoGPT-style model (random init, seed 0) and a learnable synthetic task;
2. asks the planner for the best plan on 8 CPU ranks and prints its ranking and why the
   runners-up lost; then plans again with the mesh fixed to pp 2 × dp 2 × tp 2, so the demo
   exercises every axis, and prints how much slower the cost model expects that to be;
3. prints the plan report and writes the HTML report (pipeline timeline, memory, mesh);
4. trains on 8 forked gloo ranks with a progress bar;
5. trains the same model in one process and shows that the losses match.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import statistics
import time
import warnings
from pathlib import Path
from typing import Sequence

import torch

from fairscale.api import captured, parallelize, search
from fairscale.calibrate_host import measure_runtime_host
from fairscale.closed_loop import StepRecorder, measure, predicted_terms, term_table
from fairscale.report.build import html_report, text_report
from fairscale.runtime.calibration_cache import cpu_cluster
from fairscale.runtime.launch import launch
from fairscale.runtime.mesh import RankMesh
from fairscale.testing.models import GPT, GPTConfig, lm_loss
from fairscale.testing.reference import train_reference, Case
from planner.search import cost_plan

__all__ = ["main"]

CONFIG = GPTConfig(vocab=128, seq=32, layers=4, heads=4, dim=64)
LR = 3e-3


def make_batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences where each token is a fixed function of the one before (learnable), random starts."""
    g = torch.Generator().manual_seed(7000 + step)
    start = torch.randint(0, CONFIG.vocab, (batch, 1), generator=g)
    steps = torch.arange(CONFIG.seq + 1)
    ids = (start * 5 ** (steps % 4) + 3 * steps) % CONFIG.vocab
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def build_case() -> Case:
    torch.manual_seed(0)
    return Case("demo-gpt", GPT(CONFIG), make_batch, lm_loss)


def _progress(step: int, total: int, loss: float, started: float) -> None:
    width = 30
    done = int(width * step / total)
    rate = step / max(time.perf_counter() - started, 1e-9)
    sys.stdout.write(f"\r  [{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}  "
                     f"{rate:.1f} steps/s")
    sys.stdout.flush()
    if step == total:
        sys.stdout.write("\n")


def _train(rank: int, world: int, case: Case, plan, steps: int, batch: int) -> tuple[list[float], list[float]]:
    # ``case`` is the parent's, inherited through fork: its capture is cached, so ranks skip it
    pm = parallelize(case.model, example_inputs=case.make_batch(0, batch), loss_fn=case.loss_fn, plan=plan,
                     optimizer=functools.partial(torch.optim.Adam, lr=LR))
    losses, times, started = [], [], time.perf_counter()
    terms = StepRecorder()  # per-term timings of every step after the first (collective waits, optimizer)
    for step in range(steps):
        if step:
            terms.start()
        t0 = time.perf_counter()
        losses.append(pm.train_step(case.make_batch(step, batch)))  # returns after the step's collectives
        times.append(time.perf_counter() - t0)
        if step:
            terms.stop(pm)
        if rank == 0:
            _progress(step + 1, steps, losses[-1], started)
    return losses, times, terms.summary()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fairscale demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8, help="CPU ranks (default 8)")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    parser.add_argument("--mesh", default="2,2,2", help="pp,dp,tp to fix, or 'auto' for the planner's pick")
    parser.add_argument("--html", default="fairscale-demo-plan.html", help="where to write the HTML report")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # torch's own deprecation notices (pytree internals) are not the user's business here
    warnings.filterwarnings("ignore", category=FutureWarning)

    case = build_case()
    batch = case.make_batch(0, args.batch)
    n_params = sum(p.numel() for p in case.model.parameters())
    print(f"fairscale demo: a {CONFIG.layers}-layer GPT ({n_params / 1e6:.2f} M parameters, vocab {CONFIG.vocab}, "
          f"sequence {CONFIG.seq}) on {args.devices} CPU ranks, global batch {args.batch}\n")

    t0 = time.perf_counter()
    # CPU ranks on any machine (a GPU box too): the plan, the report and the launch all say so
    # this machine's measured rates (measured on first use, then cached)
    cpu = cpu_cluster(args.devices, runtime_host=measure_runtime_host)
    free = search(case.model, batch, devices=args.devices, loss_fn=case.loss_fn, cluster=cpu)
    print(f"planner: searched in {time.perf_counter() - t0:.2f} s (capture included). Its ranking:")
    print(_indent(free.table()))
    chosen = free
    if args.mesh != "auto":
        pp, dp, tp = (int(x) for x in args.mesh.split(","))
        chosen = search(case.model, batch, devices=args.devices, loss_fn=case.loss_fn, cluster=cpu,
                        constraints={"mesh": {"pp": pp, "dp": dp, "tp": tp}})
        slower = chosen.plan.predicted.step_time_s / free.plan.predicted.step_time_s
        print(f"\nThe demo fixes the mesh to pp {pp} × dp {dp} × tp {tp} to exercise every axis; the planner "
              f"filled in the rest.\nThe cost model expects it to be {slower:.2f}× the step time of its own pick.")
    plan = chosen.plan

    graph = captured(case.model, batch, loss_fn=case.loss_fn)
    print("\n" + text_report(plan, graph))
    html = html_report(plan, graph=graph, cluster=cpu,
                       title=f"demo GPT on {args.devices} CPU ranks", path=Path(args.html))
    print(f"\nHTML report (timeline, memory, mesh): {html}\n")

    print(f"training on {args.devices} gloo ranks:")
    t0 = time.perf_counter()
    ranks = launch(_train, devices=args.devices, args=(case, plan, args.steps, args.batch), backend="gloo",
                   timeout_s=600)
    losses, times, _ = ranks[0]
    parallel_s = time.perf_counter() - t0
    print(f"  {args.steps} steps in {parallel_s:.1f} s (process start and compile included)")
    measured = statistics.median(times[1:] or times)  # the first step pays one-time allocations
    predicted = plan.predicted.step_time_s
    error = (predicted - measured) / measured
    print(f"  step time: predicted {predicted * 1e3:.1f} ms ({cpu.name}), measured {measured * 1e3:.1f} ms "
          f"(median after the first step): {error:+.0%} ({'within' if abs(error) <= 0.25 else 'OUTSIDE'} "
          f"the ±25% goal; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    if args.steps > 1:
        by_term = measure([r[2] for r in ranks], RankMesh(plan.mesh.pp, plan.mesh.dp, plan.mesh.tp, 0))
        print(_indent(term_table(predicted_terms(cost_plan(plan, graph, cpu, validate=False), plan), by_term)))
        print("  (slowest rank, median over the steps after the first: compute = step - waits - optimizer; on "
              "ranks that share cores a wait lends the core to the others)\n")

    print("the same model and batches in one process:")
    t0 = time.perf_counter()
    ref = train_reference(build_case, steps=args.steps, global_batch=args.batch, lr=LR)
    print(f"  {args.steps} steps in {time.perf_counter() - t0:.1f} s\n")

    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref.losses))
    print(f"{'step':>6}{'parallel':>14}{'one process':>14}{'rel. diff':>12}")
    for i in sorted({0, 1, 2, args.steps // 2, args.steps - 1}):
        print(f"{i:>6}{losses[i]:>14.6f}{ref.losses[i]:>14.6f}{abs(losses[i] - ref.losses[i]) / abs(ref.losses[i]):>12.1e}")
    ok = worst <= 1e-5 and losses[-1] < losses[0]
    print(f"\nloss fell from {losses[0]:.4f} to {losses[-1]:.4f}; largest relative difference from one process: "
          f"{worst:.1e} ({'matches' if worst <= 1e-5 else 'DOES NOT MATCH'} within 1e-5)")
    return 0 if ok else 1


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


if __name__ == "__main__":
    raise SystemExit(main())
