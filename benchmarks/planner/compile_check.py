"""Cost of the plan-time compilation check (``fairscale.compile_check``) inside the search.

For a tiny GPT (real weights, 8 CPU ranks) and the 1T GPT of ``speed.py`` (Megatron shapes on
``meta``, 3072 A100-80GB): the planner search without the check, then with it (the face's hook:
``checker_for(model, batch)``), and the check's parts: the capture at the winner's microbatch
shape (``torch.export``, ``annotate=False``) and the compile of each checked plan (all stages,
under ``FakeTensorMode``). Peak RSS is printed too (the check allocates no shards).

Run: ``python benchmarks/planner/compile_check.py [--tiny]`` (``--tiny``: the small model only).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from fairscale.compile_check import CompileChecker, graph_refusal
from fairscale.testing.models import GPT, GPTConfig, lm_loss
from passes.tp.patterns import propose_tp_rules
from planner.capture import capture
from planner.cluster import Cluster
from planner.graph import ModelGraph
from planner.search import search

MODELS = {  # name: (layers, hidden, heads, seq, vocab, global batch, devices, on meta)
    "tiny GPT": (4, 64, 4, 16, 128, 8, 8, False),
    "1T GPT": (128, 25600, 160, 2048, 51200, 3072, 3072, True),
}


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run(name: str, layers: int, hidden: int, heads: int, seq: int, vocab: int, batch: int, devices: int,
        meta: bool) -> None:
    device = "meta" if meta else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(GPTConfig(layers=layers, dim=hidden, heads=heads, seq=seq, vocab=vocab))
    rows = 1 if meta else batch
    ids = torch.zeros(rows, seq, dtype=torch.long, device=device)
    start = time.perf_counter()
    graph = capture(model, (ids, ids), loss_fn=lm_loss)
    cap = time.perf_counter() - start
    cluster = Cluster.preset("a100-80gb", nodes=devices // 8) if meta else Cluster.cpu(devices)
    constraints = {"data_parallel": {"param_dtype": "bf16", "reduce_dtype": "bf16"}} if meta else None
    rules = lambda tp: propose_tp_rules(graph.gm, tp=tp).rules  # noqa: E731

    start = time.perf_counter()
    plain = search(graph, cluster, global_batch=batch, constraints=constraints, tp_rules=rules)
    t_plain = time.perf_counter() - start

    checker = CompileChecker(model, (ids, ids), loss_fn=lm_loss)
    start = time.perf_counter()
    checked = search(graph, cluster, global_batch=batch, constraints=constraints, tp_rules=rules, compiles=checker)
    t_checked = time.perf_counter() - start
    n_plans = 1 + len(checked.runners_up) + len(checked.refused)

    # the parts, again, on fresh caches
    fresh = CompileChecker(model, (ids, ids), loss_fn=lm_loss)
    start = time.perf_counter()
    g = fresh.graph_for(checked.plan)
    t_capture = time.perf_counter() - start
    assert isinstance(g, ModelGraph)
    start = time.perf_counter()
    assert graph_refusal(g, checked.plan) is None
    t_compile = time.perf_counter() - start
    m = checked.plan.mesh
    print(f"{name}: capture (annotated, for the search) {cap:.2f} s; search {t_plain:.2f} s without the check, "
          f"{t_checked:.2f} s with it ({n_plans} plans checked, {len(checked.refused)} refused; "
          f"same winner: {plain.best.summary() == checked.best.summary()})")
    print(f"    winner pp={m.pp} dp={m.dp} tp={m.tp}, {m.pp * checked.plan.schedule.virtual_stages} stages: "
          f"export capture at its microbatch shape {t_capture:.2f} s, compile {t_compile:.2f} s; "
          f"peak RSS {rss_gib():.2f} GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the small model only")
    args = ap.parse_args()
    for name, spec in MODELS.items():
        if args.tiny and spec[-1]:
            continue
        run(name, *spec)


if __name__ == "__main__":
    main()
