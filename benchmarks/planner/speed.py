"""Planning speed through the public entry points: GPT 1.7B / 175B / 1T (Megatron shapes, built on
``meta``) on 32 / 1024 / 3072 A100-80GB, capture included, then the ``fairscale plan`` command.

For each model: build ``fairscale.testing.models.GPT`` on the meta device, capture it
(``fairscale.api.captured``: the capture ``fairscale.plan`` uses, cached in the process), then
``fairscale.search`` it for each cluster as ``fairscale.plan`` does (tensor-parallel rules from
the graph-based detector, ``fairscale.api.tp_rules_of``, as every way in passes them; the
plan-time compile check of the winner, ``check_runners_up=False``). The table prints the three wall times
and their sum per cell ("total" counts the model's build and capture in every cell, as a user
planning one model on one cluster would pay them), the CPU seconds of this process for the same,
and how many tensor-parallel rules the detector proposed at tp = 8 (0: TP not searched).

``--cli`` then times ``python -m fairscale plan benchmarks/planner/factories.py:gpt_1t --cluster
a100-80gb --devices 3072`` in a fresh process (interpreter start and imports included), ``--runs``
times (default 5; this machine's speed varies by ±10-15% from run to run), and says whether
fairscale's bytecode was compiled (the README's install does it).
``--analytic`` replaces build + capture by ``planner.cost_gpt.gpt_graph`` and the name-based rules
(search time only); ``--tiny`` runs one small setting to check the script works.

Goal: 1T on 3072 GPUs planned in under 10 s, capture included, on the 2-core development machine.

Run: ``python benchmarks/planner/speed.py [--cli] [--analytic] [--tiny]``
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import fairscale
from fairscale.api import captured, resolve_cluster, search_graph, tp_rules_of
from fairscale.testing.models import GPT, GPTConfig, lm_loss
from planner.api import plan_for
from planner.cost_gpt import gpt_graph
from planner.search import NoFeasiblePlan, default_tp_rules

MODELS = {  # name: (layers, hidden, heads, global batch)
    "1.7B": (24, 2304, 24, 512),     # Narayanan et al. 2021, Table 1 row 1
    "175B": (96, 12288, 96, 1536),   # GPT-3 175B (Brown et al. 2020), Megatron's batch 1536
    "1T": (128, 25600, 160, 3072),   # Table 1 last row
}
GPUS = (32, 1024, 3072)
SEQ, VOCAB = 2048, 51200
HERE = Path(__file__).resolve().parent


def build(layers: int, hidden: int, heads: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    with torch.device("meta"):
        model = GPT(GPTConfig(layers=layers, dim=hidden, heads=heads, seq=SEQ, vocab=VOCAB))
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    return model, (ids, ids)


def run_api(models: dict[str, tuple[int, int, int, int]], gpus: tuple[int, ...], analytic: bool) -> None:
    print(f"{'model':>6} {'GPUs':>5} {'build s':>8} {'capture s':>9} {'search s':>8} {'total s':>8} "
          f"{'total cpu s':>11} {'tp rules':>8} {'costed':>11}  best plan")
    for name, (layers, hidden, heads, batch) in models.items():
        cpu0, start = time.process_time(), time.perf_counter()
        if analytic:
            graph = gpt_graph(layers=layers, hidden=hidden, heads=heads, seq=SEQ, vocab=VOCAB)
            model, batch_in = None, None
            built = cap = time.perf_counter()
            rules = default_tp_rules(graph)
            n_rules = len(rules)
        else:
            model, batch_in = build(layers, hidden, heads)
            built = time.perf_counter()
            graph = captured(model, batch_in, loss_fn=lm_loss)
            cap = time.perf_counter()
            n_rules = len(tp_rules_of(graph)(8))
        cpu_graph = time.process_time() - cpu0
        for n in gpus:
            t0, cpu1 = time.perf_counter(), time.process_time()
            try:
                if model is None:
                    res = plan_for(graph, "a100-80gb", devices=n, global_batch=batch, tp_rules=rules)
                else:  # the public entry point (its capture is cached from above)
                    res = fairscale.search(model, batch_in, loss_fn=lm_loss, cluster="a100-80gb", devices=n,
                                           global_batch=batch, check_runners_up=False)  # = fairscale.plan
                what, costed = res.best.summary(), f"{res.evaluated}/{res.considered}"
            except NoFeasiblePlan as exc:
                what, costed = f"infeasible, short {exc.shortfall_bytes / 2**30:.0f} GiB/device", "-"
            took = time.perf_counter() - t0
            total = built - start + cap - built + took
            cpu = cpu_graph + time.process_time() - cpu1
            print(f"{name:>6} {n:>5} {built - start:8.2f} {cap - built:9.2f} {took:8.2f} {total:8.2f} {cpu:11.2f} "
                  f"{n_rules:>8} {costed:>11}  {what}")


def _bytecode_cached() -> bool:
    """Whether fairscale's modules have compiled bytecode to load (the README's install writes it);
    without it a fresh process compiles them first, about 2 s on the development machine."""
    import importlib.util

    import fairscale.api

    src = Path(fairscale.api.__file__)
    pyc = Path(importlib.util.cache_from_source(str(src)))
    return pyc.exists() and pyc.stat().st_mtime >= src.stat().st_mtime


def run_cli(runs: int) -> None:
    cmd = [sys.executable, "-m", "fairscale", "plan", f"{HERE / 'factories.py'}:gpt_1t", "--cluster", "a100-80gb",
           "--devices", "3072"]
    walls, cpus, plans = [], [], set()
    for _ in range(runs):
        start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        plans.add(out.stdout)
    lines = [line for line in out.stderr.splitlines() if line.startswith(("captured", "best:"))]
    print(f"fairscale plan (1T on 3072 A100, fresh process, bytecode {'cached' if _bytecode_cached() else 'NOT cached'}):"
          f" median {statistics.median(walls):.2f} s wall over {runs} runs "
          f"({', '.join(f'{w:.2f}' for w in walls)}; CPU-s {', '.join(f'{c:.2f}' for c in cpus)}); "
          f"{'the same plan JSON every run' if len(plans) == 1 else f'{len(plans)} DIFFERENT plans'}")
    for line in lines:
        print("  " + line)
    # the command and the API plan the same thing (tests/test_cli.py checks the plans are equal)
    model, batch_in = build(*MODELS["1T"][:3])
    api = search_graph(captured(model, batch_in, loss_fn=lm_loss), resolve_cluster(3072, "a100-80gb"),
                       global_batch=3072)
    print(f"  fairscale.search in this process: {api.best.summary().split(':')[0]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--analytic", action="store_true", help="skip build + capture; analytic GPT facts")
    ap.add_argument("--tiny", action="store_true", help="one small setting, to check the script runs")
    ap.add_argument("--cli", action="store_true", help="also time the fairscale plan command for 1T on 3072")
    ap.add_argument("--runs", type=int, default=5, help="how many times --cli runs the command (default 5)")
    args = ap.parse_args()
    models = {"tiny": (4, 256, 8, 64)} if args.tiny else MODELS
    run_api(models, (16,) if args.tiny else GPUS, args.analytic)
    if args.cli:
        run_cli(args.runs)


if __name__ == "__main__":
    main()
