"""Planning speed: GPT 1.7B / 175B / 1T (Megatron shapes, built on ``meta``) on 32 / 1024 / 3072
A100-80GB GPUs, capture included.

For each model: build ``fairscale.testing.models.GPT`` on the meta device, ``planner.capture``
it (FLOPs, saved bytes, blocks on fake tensors), then ``planner.search`` it for each cluster.
The table prints the three wall times separately and their sum per cell ("total" counts the
model's build and capture in every cell, as a user planning one model on one cluster would pay
them), and the same total in CPU seconds of this process (a steadier number on a shared machine).
Goal: 1T on 3072 GPUs under 10 s on a 2-core machine.

``--analytic`` replaces build + capture by ``planner.cost_gpt.gpt_graph`` (search time only);
``--tiny`` runs one small setting to check the script works.

Run: ``python benchmarks/planner/speed.py [--analytic] [--tiny]``
"""

from __future__ import annotations

import argparse
import time

import torch

from planner.cluster import Cluster
from planner.cost_gpt import gpt_graph
from planner.graph import ModelGraph
from planner.search import NoFeasiblePlan, search

MODELS = {  # name: (layers, hidden, heads, global batch)
    "1.7B": (24, 2304, 24, 512),     # Narayanan et al. 2021, Table 1 row 1
    "175B": (96, 12288, 96, 1536),   # GPT-3 175B (Brown et al. 2020), Megatron's batch 1536
    "1T": (128, 25600, 160, 3072),   # Table 1 last row
}
GPUS = (32, 1024, 3072)
SEQ, VOCAB = 2048, 51200


def build_and_capture(layers: int, hidden: int, heads: int) -> tuple[ModelGraph, float, float]:
    from fairscale.testing.models import GPT, GPTConfig, lm_loss
    from planner.capture import capture

    start = time.perf_counter()
    with torch.device("meta"):
        model = GPT(GPTConfig(layers=layers, dim=hidden, heads=heads, seq=SEQ, vocab=VOCAB))
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    built = time.perf_counter()
    graph = capture(model, (ids, ids), loss_fn=lm_loss)
    return graph, built - start, time.perf_counter() - built


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--analytic", action="store_true", help="skip build + capture; use the analytic GPT facts")
    ap.add_argument("--tiny", action="store_true", help="one small setting, to check the script runs")
    args = ap.parse_args()
    models = {"tiny": (4, 256, 8, 64)} if args.tiny else MODELS
    gpus = (16,) if args.tiny else GPUS
    constraints = {"data_parallel": {"param_dtype": "bf16", "reduce_dtype": "bf16"}}
    print(f"{'model':>6} {'GPUs':>5} {'build s':>8} {'capture s':>9} {'search s':>8} {'total s':>8} {'total cpu s':>11} "
          f"{'costed':>13}  best plan")
    for name, (layers, hidden, heads, batch) in models.items():
        cpu0 = time.process_time()
        if args.analytic:
            start = time.perf_counter()
            graph = gpt_graph(layers=layers, hidden=hidden, heads=heads, seq=SEQ, vocab=VOCAB)
            build, cap = time.perf_counter() - start, 0.0
        else:
            graph, build, cap = build_and_capture(layers, hidden, heads)
        cpu_graph = time.process_time() - cpu0
        for n in gpus:
            cluster = Cluster.preset("a100-80gb", nodes=max(1, n // 8))
            start, cpu1 = time.perf_counter(), time.process_time()
            try:
                res = search(graph, cluster, global_batch=batch, constraints=constraints)
                what = res.best.summary()
                costed = f"{res.evaluated}/{res.considered}"
            except NoFeasiblePlan as exc:
                what = f"infeasible, short {exc.shortfall_bytes / 2**30:.0f} GiB/device"
                costed = "-"
            took, cpu = time.perf_counter() - start, cpu_graph + time.process_time() - cpu1
            print(f"{name:>6} {n:>5} {build:8.2f} {cap:9.2f} {took:8.2f} {build + cap + took:8.2f} {cpu:11.2f} "
                  f"{costed:>13}  {what}")


if __name__ == "__main__":
    main()
