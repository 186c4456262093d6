"""Re-cost a stored end-to-end run with today's cost model, on the measurements it was run with:
what a change to the model alone does to the predicted-against-measured errors, without the 20%
that the same plan moves between two runs of this machine.

    python benchmarks/end_to_end/repredict.py                     # result.json, cpu_cluster.json
    python benchmarks/end_to_end/repredict.py --result r.json --cluster c.json --refit-ranges

``--refit-ranges`` fits ``Cluster.collective_ranges`` (calibration version 9) from the stored
calibration's own collective timings (``fairscale.runtime.calibrate_fit.collective_ranges``), for a
calibration written before version 9; ``--core-idle X`` sets ``Cluster.core_idle`` (version 10),
for a calibration that did not measure it. Each plan of the run is re-costed with
``planner.search.cost_plan`` (as ``bench_e2e.py`` predicts) and printed next to its stored
prediction and measured step time, with the median and largest error and Kendall's tau.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from bench_e2e import CLUSTER_JSON, HERE, kendall_tau, predict
from fairscale.api import captured
from fairscale.runtime.calibrate_fit import collective_ranges
from fairscale.testing.models import build
from planner.cluster import Cluster
from planner.plan import Plan


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--result", type=Path, default=HERE / "result.json")
    ap.add_argument("--cluster", type=Path, default=CLUSTER_JSON)
    ap.add_argument("--refit-ranges", action="store_true", help="fit collective_ranges from the stored timings")
    ap.add_argument("--core-idle", type=float, help="Cluster.core_idle to cost with (a calibration before version 10)")
    args = ap.parse_args(argv)
    run = json.loads(args.result.read_text())
    stored = json.loads(args.cluster.read_text())
    cluster = Cluster.from_dict(stored["cluster"])
    if args.refit_ranges:
        cluster = dataclasses.replace(cluster, collective_ranges=collective_ranges(stored["collectives"], stored["ranks"]))
    if args.core_idle is not None:
        cluster = dataclasses.replace(cluster, core_idle=args.core_idle)
    cfg = run["config"]
    case = build("gpt", **cfg["model"])
    graph = captured(case.model, case.make_batch(0, cfg["batch"]), loss_fn=case.loss_fn)
    then, now, measured = [], [], []
    print(f"{'plan':18s} {'measured s':>10s} {'stored pred':>16s} {'re-costed':>16s}")
    for row in run["rows"]:
        if "error" in row:
            continue
        plan = Plan.from_dict(run["plans"][row["plan"]])
        seconds = predict(plan, graph, cluster, cfg["batch"]).step_time_s
        m = row["meas_step_s"]
        then.append(row["pred_step_s"])
        now.append(seconds)
        measured.append(m)
        print(f"{row['plan']:18s} {m:10.3f} {then[-1]:9.3f} ({(then[-1] - m) / m:+4.0%}) {seconds:9.3f} ({(seconds - m) / m:+4.0%})")
    out = {}
    for name, pred in (("stored", then), ("re-costed", now)):
        errors = [abs(p - m) / m for p, m in zip(pred, measured)]
        out[name] = {"median": statistics.median(errors), "max": max(errors), "tau": kendall_tau(pred, measured)}
        print(f"{name:10s}: median {out[name]['median']:.1%}, max {out[name]['max']:.1%}, tau {out[name]['tau']:.2f}")
    return out


if __name__ == "__main__":
    main()
