"""Capture time and peak memory for GPT shapes built on ``meta`` (no parameter memory).

Each shape runs in a fresh Python process so that its peak RSS is its own. Printed per shape:
build time (the meta model), cold capture (first call in the process, including torch's lazy
imports), warm capture (second call), CPU time of the warm capture, peak RSS, and the FLOPs capture
counted against the Megatron-LM formula for one step without recompute,
``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))`` (Narayanan et al. 2021, eq. 3 with the recompute pass
removed: 3 passes of matmuls instead of 4).

Usage::

    python benchmarks/capture/bench_capture.py                    # 1.7B, 175B (GPT-3), 1T
    python benchmarks/capture/bench_capture.py --shapes all       # every row of Megatron Table 1
    python benchmarks/capture/bench_capture.py --shapes 1.7B --tracer export
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

TABLE = Path(os.environ.get("FS_MEGATRON_TABLE", "/work/shared/reference/megatron2021_table1.csv"))
SEQ, VOCAB = 2048, 51200
# GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, hidden 12288, 96 heads; not a row of Table 1
GPT3 = {"name": "175B", "layers": 96, "hidden": 12288, "heads": 96}


def shapes() -> dict[str, dict[str, int | str]]:
    out: dict[str, dict[str, int | str]] = {}
    if TABLE.exists():
        with TABLE.open() as f:
            for row in csv.DictReader(line for line in f if not line.startswith("#")):
                billions = float(row["params_billion"])
                name = "1T" if billions > 1000 else f"{billions:g}B"
                out[name] = {"name": name, "layers": int(row["layers"]), "hidden": int(row["hidden"]),
                             "heads": int(row["heads"])}
    else:  # the three rows this benchmark reports, from Table 1
        out["1.7B"] = {"name": "1.7B", "layers": 24, "hidden": 2304, "heads": 24}
        out["1T"] = {"name": "1T", "layers": 128, "hidden": 25600, "heads": 160}
    out["175B"] = dict(GPT3)
    return out


def child(spec: dict[str, int | str], tracer: str, batch: int) -> dict[str, object]:
    """Runs in the fresh process: build on meta, capture twice, measure."""
    import resource
    import time

    t0 = time.perf_counter()
    import torch

    from fairscale.testing.models import GPT, GPTConfig, lm_loss
    from planner.capture import capture

    torch.set_num_threads(1)
    imported = time.perf_counter()
    layers, hidden, heads = int(spec["layers"]), int(spec["hidden"]), int(spec["heads"])
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=VOCAB, seq=SEQ, layers=layers, heads=heads, dim=hidden))
    ids = torch.zeros(batch, SEQ, dtype=torch.long, device="meta")
    built = time.perf_counter()
    graph = capture(model, (ids, ids), loss_fn=lm_loss, tracer=tracer)  # type: ignore[arg-type]
    cold = time.perf_counter()
    cpu = time.process_time()
    graph = capture(model, (ids, ids), loss_fn=lm_loss, tracer=tracer)  # type: ignore[arg-type]
    warm_cpu = time.process_time() - cpu
    warm = time.perf_counter()
    megatron = 72 * batch * SEQ * layers * hidden ** 2 * (1 + SEQ / (6 * hidden) + VOCAB / (12 * layers * hidden))
    return {
        "shape": spec["name"], "layers": layers, "hidden": hidden, "heads": heads,
        "params_billion": round(graph.num_parameters / 1e9, 2), "tracer": graph.tracer,
        "nodes": graph.extra["nodes"], "replicated_nodes": graph.extra.get("replicated_nodes", 0),
        "import_s": round(imported - t0, 2), "build_s": round(built - imported, 2),
        "capture_cold_s": round(cold - built, 2), "capture_warm_s": round(warm - cold, 2),
        "capture_warm_cpu_s": round(warm_cpu, 2),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 3),
        "flops_per_step": graph.flops_per_step, "flops_vs_megatron": round(graph.flops_per_step / megatron, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1.7B,175B,1T", help="comma list of names, or 'all'")
    parser.add_argument("--tracer", default="auto", choices=["auto", "fx", "export"])
    parser.add_argument("--batch", type=int, default=1, help="sequences per captured batch")
    parser.add_argument("--json", action="store_true", help="print one JSON object per shape")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child), args.tracer, args.batch)))
        return
    table = shapes()
    names = list(table) if args.shapes == "all" else args.shapes.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"unknown shapes {unknown}; choose from {list(table)} or 'all'")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    header = (f"{'shape':>6} {'layers':>6} {'hidden':>6} {'params':>8} {'tracer':>6} {'nodes':>6} "
              f"{'build s':>7} {'cold s':>7} {'warm s':>7} {'warm cpu':>8} {'peak RSS':>9} {'FLOPs/Megatron':>14}")
    if not args.json:
        print(header)
    for name in names:
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(table[name]), "--tracer", args.tracer,
                               "--batch", str(args.batch)], capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            print(f"{name}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
            sys.exit(1)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        if args.json:
            print(json.dumps(r))
            continue
        print(f"{r['shape']:>6} {r['layers']:>6} {r['hidden']:>6} {r['params_billion']:>7}B {r['tracer']:>6} "
              f"{r['nodes']:>6} {r['build_s']:>7} {r['capture_cold_s']:>7} {r['capture_warm_s']:>7} "
              f"{r['capture_warm_cpu_s']:>8} {r['peak_rss_gib']:>7}Gi {r['flops_vs_megatron']:>14}")


if __name__ == "__main__":
    main()
