"""The cost model against published runs, with each run's own settings pinned: Narayanan et al.
2021 (Megatron-LM), Table 1.

For each of the ten GPT rows (1.7B to 1T parameters, sequence 2048, vocabulary 51200, A100-80GB):

1. **Prediction vs publication.** The plan the row actually ran (``planner.cost_gpt.TABLE1``: tp,
   pp, microbatch size, 1F1B or interleaved with its chunks, full recompute, fp16, Megatron's
   local or PyTorch DDP, from the paper's own ``examples/sc21`` scripts; ``megatron_plan`` spells
   it as a fairscale plan) is costed through ``planner.search.cost_plan`` with the runtime
   options of that code (``CostOptions.megatron2021``: blocking TP and p2p, the scatter/gather
   p2p optimization, local DDP after the last backward or torch DDP during it). The published
   step time is derived from the paper's own FLOP count, ``F = 96·B·s·l·h²·(1 + s/6h + V/16lh)``
   per iteration (eq. 3, recompute included), over the published TFLOP/s per GPU:
   ``t = F / (TFLOP/s · GPUs)``. The table prints both, the error, and the predicted step split
   into its terms (seconds on the slowest rank), so a miss can be traced to a term.
2. **Search vs expert.** ``planner.api.plan_for`` searches the same model and cluster under the
   same cost model and runtime (same options, fp16, same gradient buckets) with no other
   constraint; its best plan's predicted step time is divided by the expert plan's.

Pure computation, deterministic: ``python benchmarks/planner/megatron_quality.py [--rows 1,10]``.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from planner.api import plan_for
from planner.cluster import Cluster
from planner.cost import CostOptions
from planner.cost_gpt import TABLE1, MegatronRun, megatron_plan
from planner.search import cost_plan, default_tp_rules
from planner.search.config import Breakdown

TABLE = Path("/work/shared/reference/megatron2021_table1.csv")
GOAL_ERROR = 0.10


def check_table(path: Path) -> None:
    """The pinned rows must be the reference table's (model shapes, mesh, batch, TFLOP/s)."""
    if not path.exists():
        return
    with path.open() as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    for run, row in zip(TABLE1, rows, strict=True):
        have = (run.name, run.heads, run.hidden, run.layers, run.tp, run.pp, run.gpus, run.global_batch,
                run.published_tflops)
        want = (row["params_billion"], int(row["heads"]), int(row["hidden"]), int(row["layers"]), int(row["tp"]),
                int(row["pp"]), int(row["gpus"]), int(row["global_batch"]), float(row["achieved_tflops_per_gpu"]))
        assert have == want, f"planner.cost_gpt.TABLE1 disagrees with {path}: {have} vs {want}"


def expert(run: MegatronRun) -> tuple[Breakdown, Cluster, CostOptions]:
    """The pinned plan's predicted cost, the cluster and the runtime options it is costed with."""
    g = run.graph()
    cluster = Cluster.preset("a100-80gb", devices=run.gpus)
    opts = CostOptions.megatron2021(torch_ddp=run.torch_ddp)
    plan = megatron_plan(run, g, default_tp_rules(g))
    return cost_plan(plan, g, cluster, options=opts), cluster, opts


def terms(b: Breakdown) -> str:
    """The predicted step split into its terms (seconds, slowest rank)."""
    return (f"{b.compute_s:7.2f} {b.recompute_s:6.2f} {b.bubble_s:6.2f} {b.tp_comm_s:5.2f} {b.p2p_s:5.2f} "
            f"{b.dp_comm_s:5.2f} {b.optimizer_s:5.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="", help="comma-separated 1-based rows (default: all)")
    ap.add_argument("--table", type=Path, default=TABLE, help="reference CSV to check the pinned rows against")
    args = ap.parse_args()
    check_table(args.table)
    pick = [int(x) - 1 for x in args.rows.split(",")] if args.rows else range(len(TABLE1))
    print("prediction vs publication (the run's own plan; terms in seconds on the slowest rank)")
    print(f"{'model':>7} {'tp/pp/dp':>10} {'mb':>3} {'v':>2} {'ddp':>5} {'published s':>11} {'predicted s':>11} "
          f"{'error':>7} | {'compute':>7} {'recomp':>6} {'bubble':>6} {'tp':>5} {'p2p':>5} {'dp':>5} {'opt':>5}")
    results = []
    for i in pick:
        run = TABLE1[i]
        b, cluster, opts = expert(run)
        published = run.published_step_s()
        err = b.step_time_s / published - 1
        results.append((run, b, cluster, opts, err))
        print(f"{run.name:>6}B {run.tp:>3}/{run.pp}/{run.dp:<4} {run.micro_batch:>3} {run.chunks:>2} "
              f"{'torch' if run.torch_ddp else 'local':>5} {published:11.2f} {b.step_time_s:11.2f} {100 * err:+6.1f}% | "
              f"{terms(b)}")
    errors = [r[4] for r in results]
    print(f"max |error| {100 * max(abs(e) for e in errors):.1f}% (goal <= {100 * GOAL_ERROR:.0f}%); "
          f"mean {100 * sum(errors) / len(errors):+.1f}%")
    print()
    print("search vs expert (same cost model, same runtime, fp16; search unconstrained otherwise)")
    print(f"{'model':>7} {'expert s':>9} {'ours s':>9} {'ours/expert':>11} {'plan s':>7}  our plan")
    ratios = []
    for run, b, cluster, opts, _ in results:
        g = run.graph()
        bucket = 25.0 if run.torch_ddp else float(2**20)
        start = time.perf_counter()
        res = plan_for(g, cluster, global_batch=run.global_batch, tp_rules=default_tp_rules(g), options=opts,
                       constraints={"data_parallel": {"param_dtype": "fp16", "reduce_dtype": "fp16",
                                                      "bucket_mb": bucket}})
        took = time.perf_counter() - start
        ours = res.best.breakdown
        ratios.append(ours.step_time_s / b.step_time_s)
        print(f"{run.name:>6}B {b.step_time_s:9.2f} {ours.step_time_s:9.2f} {ratios[-1]:11.3f} {took:7.2f}  "
              f"{res.best.summary().split(':')[0]}")
    print(f"worst ours/expert {max(ratios):.3f} (goal <= 1)")


if __name__ == "__main__":
    main()
