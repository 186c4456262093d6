"""Plan quality against the expert configurations of Narayanan et al. 2021, Table 1.

For each of the 10 GPT rows (1.7B to 1T, sequence 2048, vocabulary 51200, A100-80GB):

* the expert configuration (its tp, pp, dp and global batch; Megatron-LM's defaults for what the
  table does not list: microbatch size 1, the 1F1B schedule, full activation recompute of every
  block, layers split evenly with the embeddings on the first stage and the head on the last,
  fp16 mixed precision, gradients all-reduced without ZeRO in one call over the whole buffer) is
  costed by our model, and its
  predicted TFLOP/s per GPU (the paper's FLOP count F over the predicted step time) is compared
  with the published figure;
* the planner searches the same model and cluster freely (only the dtypes and the one-call gradient
  reduction of that runtime are fixed) and its plan's predicted step time is divided by the expert's.

Both are costed with ``CostOptions.megatron2021()`` (no DP/TP/p2p overlap, as in that runtime),
and with the analytic Megatron GPT of ``planner.cost_gpt`` (whose activation bytes are those of
Megatron's 2021 kernels: no flash attention, dropout masks saved), because the published numbers
were measured with those kernels. Pure computation: the output is deterministic.

Run: ``python benchmarks/planner/megatron_quality.py [--rows 1,10]``
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from planner.cluster import Cluster
from planner.cost import CostOptions
from planner.cost_gpt import gpt_graph, megatron_flops
from planner.search import default_tp_rules, search
from planner.search.core import make_context
from planner.search.config import Breakdown, Config
from planner.search.evaluate import evaluate

TABLE = Path("/work/shared/reference/megatron2021_table1.csv")
SEQ, VOCAB = 2048, 51200
# Megatron-LM (2021) all-reduces its whole contiguous gradient buffer in one call: one "bucket"
WHOLE_BUFFER_MB = float(2**20)
DTYPES = {"data_parallel": {"param_dtype": "fp16", "reduce_dtype": "fp16", "bucket_mb": WHOLE_BUFFER_MB}}


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def expert(row: dict[str, str]) -> tuple[Breakdown, float]:
    """(the expert configuration's predicted cost, its predicted TFLOP/s per GPU as the paper counts)."""
    h, a, l, tp, pp, n, batch = (int(row[k]) for k in ("hidden", "heads", "layers", "tp", "pp", "gpus",
                                                      "global_batch"))
    g = gpt_graph(layers=l, hidden=h, heads=a, seq=SEQ, vocab=VOCAB)
    ctx = make_context(g, Cluster.preset("a100-80gb", nodes=n // 8), global_batch=batch, rules=default_tp_rules(g),
                       options=CostOptions.megatron2021())
    dp, per = n // (tp * pp), l // pp
    # wte, wpe + the first `per` blocks on stage 0; ln_f and lm_head with the last blocks
    cuts = (0, *[2 + per * k for k in range(1, pp)], len(ctx.facts))
    rec = frozenset(i for i, f in enumerate(ctx.facts) if f.block)
    b = evaluate(ctx, Config(pp=pp, dp=dp, tp=tp, microbatches=batch // dp, kind="1f1b", dp_kind="ddp",
                             param_dtype="fp16", reduce_dtype="fp16", bucket_mb=WHOLE_BUFFER_MB, cuts=cuts,
                             recompute=rec))
    flops = megatron_flops(batch=batch, seq=SEQ, layers=l, hidden=h, vocab=VOCAB)
    return b, flops / b.step_time_s / n / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=Path, default=TABLE)
    ap.add_argument("--rows", default="", help="comma-separated 1-based rows (default: all)")
    args = ap.parse_args()
    data = rows(args.table)
    pick = [int(x) - 1 for x in args.rows.split(",")] if args.rows else range(len(data))
    print(f"{'model':>7} {'expert tp/pp/dp':>15} {'expert s':>9} {'pred TF':>8} {'paper TF':>8} {'error':>7} | "
          f"{'ours s':>9} {'ours/expert':>11} {'plan s':>7}  our plan")
    errors, ratios = [], []
    for i in pick:
        row = data[i]
        b, tflops = expert(row)
        published = float(row["achieved_tflops_per_gpu"])
        err = tflops / published - 1
        h, a, l, n, batch = (int(row[k]) for k in ("hidden", "heads", "layers", "gpus", "global_batch"))
        g = gpt_graph(layers=l, hidden=h, heads=a, seq=SEQ, vocab=VOCAB)
        start = time.perf_counter()
        res = search(g, Cluster.preset("a100-80gb", nodes=n // 8), global_batch=batch, constraints=DTYPES,
                     options=CostOptions.megatron2021())
        took = time.perf_counter() - start
        ours = res.best.breakdown
        ratio = ours.step_time_s / b.step_time_s
        errors.append(err)
        ratios.append(ratio)
        c = ours.config
        assert c is not None
        plan = (f"pp={c.pp} dp={c.dp} tp={c.tp}{' sp' if c.sp else ''} {c.kind}"
                f"{'x' + str(c.v) if c.v > 1 else ''} m={c.microbatches} {c.dp_kind} recompute {len(c.recompute)}/{l}")
        print(f"{row['params_billion']:>6}B {row['tp']:>5}/{row['pp']}/{n // (int(row['tp']) * int(row['pp'])):<5}"
              f" {b.step_time_s:9.2f} {tflops:8.1f} {published:8.0f} {100 * err:+6.1f}% | {ours.step_time_s:9.2f} "
              f"{ratio:11.3f} {took:7.2f}  {plan}")
    print(f"max |error| {100 * max(abs(e) for e in errors):.1f}% (goal <= 15%); "
          f"worst ours/expert {max(ratios):.3f} (goal <= 1)")


if __name__ == "__main__":
    main()
