"""Regenerate the conformance corpus's result table: every model x plan -> exact / refused.

    python benchmarks/corpus/run.py                     # the whole registry, every plan kind
    python benchmarks/corpus/run.py --default-tier      # the subset the default test tier runs
    python benchmarks/corpus/run.py --models hf-llama,hf-t5 --plans pp2xtp2

Plans each model through the public API, trains it on 4 gloo CPU ranks and compares with one
process (``fairscale.testing.corpus_run``; what each outcome means is there). Writes the markdown
table and a JSON of every result (``--out``, default ``benchmarks/corpus/results.{md,json}``)
and prints the table; exits 1 if any case is DIFFERS, CRASH or a refusal whose message lacks
module, op, source line or remedy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("FAIRSCALE_NO_CALIBRATE", "1")  # plan for Cluster.cpu's fixed figures: same plans everywhere
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from fairscale.testing.corpus import models  # noqa: E402
from fairscale.testing.corpus_run import PLANS, from_json, run_cases, table, to_json  # noqa: E402

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", help="comma-separated corpus names (default: all)")
    ap.add_argument("--default-tier", action="store_true", help="only the models of the default test tier")
    ap.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated plan kinds (default: {','.join(PLANS)})")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--out", default=str(HERE / "results"), help="path stem of the .md and .json written")
    ap.add_argument("--render", metavar="JSON", help="re-render the tables of a saved results .json (no run)")
    args = ap.parse_args(argv)
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        results = from_json(saved["results"])
        plans = list(dict.fromkeys(r.plan for r in results))
        counts = {o: sum(r.outcome == o for r in results) for o in ("exact", "refused", "DIFFERS", "CRASH")}
        summary = (f"{len(results)} cases: " + ", ".join(f"{v} {k}" for k, v in counts.items())
                   + f"; {saved['seconds']:.0f} s on {saved['machine']}")
        stem = args.render.removesuffix(".json")
        Path(stem + ".md").write_text(table(results, plans) + "\n\n" + summary + "\n")
        Path(stem + ".short.md").write_text(table(results, plans, width=140) + "\n\n" + summary + "\n")
        print(summary)
        return 0
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    registry = models()
    names = args.models.split(",") if args.models else [n for n, m in registry.items()
                                                        if m.default_tier or not args.default_tier]
    plans = args.plans.split(",")
    start = time.perf_counter()
    results = run_cases(names, plans, devices=args.devices)
    seconds = time.perf_counter() - start
    md = table(results, plans)
    counts = {o: sum(r.outcome == o for r in results) for o in ("exact", "refused", "DIFFERS", "CRASH")}
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
               f"{args.devices} gloo CPU ranks, float32, SGD lr 0.1, 3 steps")
    summary = (f"{len(results)} cases: " + ", ".join(f"{v} {k}" for k, v in counts.items())
               + f"; {seconds:.0f} s on {machine}")
    Path(args.out + ".md").write_text(md + "\n\n" + summary + "\n")
    Path(args.out + ".short.md").write_text(table(results, plans, width=140) + "\n\n" + summary + "\n")
    Path(args.out + ".json").write_text(json.dumps(dict(machine=machine, seconds=round(seconds, 1),
                                                        results=to_json(results)), indent=1) + "\n")
    print(md)
    print(summary)
    bad = [r for r in results if not r.ok]
    for r in bad:
        print("\n" + r.describe()[:4000])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
