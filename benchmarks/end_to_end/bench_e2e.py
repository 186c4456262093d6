"""End-to-end benchmark: the plan ``fairscale.search`` picks against a grid of hand-picked plans,
trained on CPU gloo ranks, with the cost model's predicted step time and memory next to the
measured ones (issue 7).

    python benchmarks/end_to_end/bench_e2e.py                      # 8 ranks, the default GPT
    python benchmarks/end_to_end/bench_e2e.py --calibrate          # re-measure the CPU first
    python benchmarks/end_to_end/bench_e2e.py --tiny               # smoke run (seconds, numbers meaningless)

Steps:

1. The cluster: ``cpu_cluster.json`` next to this file (written by ``--calibrate``, which runs
   ``fairscale.runtime.calibrate.calibrate_cpu`` for the same number of ranks), else a fresh
   calibration. The cost model uses it with ``CostOptions.for_runtime`` (nothing overlapped on CPU).
2. The plans: pure data parallelism over all ranks (DDP, ZeRO-2, FSDP), the (pp, dp, tp) meshes
   2×2×2, 2×1×4, 4×2×1, 1×2×4, 1×1×8, 8×1×1, and the searched plan (``search``). Hand plans
   take the TP pass's proposed rules and stages with the repeated blocks spread evenly.
3. Each plan is predicted (``planner.search.cost_plan``) and then trained in ONE launch: every
   rank builds each plan with ``fairscale.parallelize``, runs ``--warmup`` steps, then times
   ``--steps`` steps (barrier, step, barrier; the median), then one more step measures memory.
4. Memory per rank: model states are the bytes of this rank's parameter, gradient and optimizer
   state storages (distinct storages, parameters and shards both); activations and buffers are the
   runtime's own meter of one step run with ``measure_memory=True`` (``pm.memory_report()``,
   :mod:`fairscale.runtime.memory_report`): activations are the peak of the bytes held for backward
   (saved tensors, what recompute regions retain, and what a recompute holds in backward), buffers
   the peak of FSDP's gathered units and unsharded gradients. Predictions are the plan's
   ``Breakdown.memory_parts`` of the rank's pipeline stage.

Prints a table per plan (predicted vs measured, errors) and the ratio of the searched plan's
measured step time to the best hand-picked one (goal <= 1.05). ``--out`` writes every number as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fairscale
from fairscale.api import captured, parallelize, search
from fairscale.closed_loop import measure, predicted_terms, rank_summary
from fairscale.runtime.mesh import RankMesh
from fairscale.calibrate_host import measure_runtime_host
from fairscale.runtime.cpu_meter import CpuIn, core_times, cpu_s
from fairscale.runtime.calibrate import CALIBRATION_VERSION, calibrate_cpu, load_calibration, machine_description, save_calibration
from fairscale.testing.models import build
from passes.ops.flight import RECORDER
from passes.tp.patterns import propose_tp_rules
from planner.cluster import Cluster
from planner.graph import ModelGraph
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage, TensorParallel
from planner.search import Breakdown, cost_plan
from planner.selectors import format_layers

HERE = Path(__file__).resolve().parent
CLUSTER_JSON = HERE / "cpu_cluster.json"

# name: (pp, dp, tp, schedule, microbatches, dp kind, recompute)
GRID: dict[str, tuple[int, int, int, str, int, str, dict[str, str]]] = {
    "1x8x1 ddp": (1, 8, 1, "1f1b", 1, "ddp", {}),
    "1x8x1 zero2": (1, 8, 1, "1f1b", 1, "zero2", {}),
    "1x8x1 fsdp": (1, 8, 1, "1f1b", 1, "fsdp", {}),
    "2x2x2 1f1b": (2, 2, 2, "1f1b", 4, "ddp", {}),
    "2x1x4 1f1b": (2, 1, 4, "1f1b", 4, "ddp", {}),
    "4x2x1 1f1b": (4, 2, 1, "1f1b", 4, "ddp", {}),
    "1x2x4 ddp": (1, 2, 4, "1f1b", 1, "ddp", {}),
    "1x1x8 tp": (1, 1, 8, "1f1b", 1, "ddp", {}),
    "8x1x1 1f1b": (8, 1, 1, "1f1b", 8, "ddp", {}),
    "2x2x2 recompute": (2, 2, 2, "1f1b", 4, "ddp", {"layers.*": "full"}),
}
SEARCHED = "searched"


def stages_for(layers: list[str], n: int) -> list[Stage]:
    """n contiguous stages with the repeated blocks spread evenly (embeddings first, head last)."""
    blocks = [i for i, name in enumerate(layers) if name.startswith("layers.")]
    if len(blocks) < n:
        raise ValueError(f"{n} stages need at least {n} blocks; the model has {len(blocks)}")
    cuts = [0] + [blocks[round(k * len(blocks) / n)] for k in range(1, n)] + [len(layers)]
    return [Stage(layers=format_layers(layers[a:b])) for a, b in zip(cuts, cuts[1:])]


def hand_plan(graph: ModelGraph, spec: tuple[Any, ...], global_batch: int) -> Plan:
    pp, dp, tp, kind, micro, dp_kind, recompute = spec
    names = [layer.name for layer in graph.layers]
    rules = propose_tp_rules(graph.gm, tp=tp).rules if tp > 1 else {}
    return Plan(mesh=Mesh(pp=pp, dp=dp, tp=tp),
                schedule=Schedule(kind=kind, microbatches=micro, global_batch=global_batch),
                stages=stages_for(names, pp) if pp > 1 else [],
                tensor_parallel=TensorParallel(rules=rules),
                data_parallel=DataParallel(kind=dp_kind, units="layers.*" if dp_kind == "fsdp" else ""),
                recompute=dict(recompute))


def _storages(tensors: Any) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
            out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return out


def state_bytes(pm: Any) -> dict[str, int]:
    """Bytes of this rank's parameters (module tensors and optimizer shards), gradients and optimizer states."""
    params: list[torch.Tensor] = [p for s in pm.local_stages for p in pm.modules[s].parameters()]
    params += list(pm.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for opt in pm.optimizer.optimizers for st in opt.optimizer.state.values() for v in st.values()
              if isinstance(v, torch.Tensor) and v.numel() > 1]
    p, g, o = _storages(params), _storages(grads), _storages(states)
    return {"parameters": sum(p.values()), "gradients": sum(v for k, v in g.items() if k not in p),
            "optimizer": sum(o.values())}


def run_plans(rank: int, world: int, cfg: dict[str, Any], plans: dict[str, Plan], cluster: Cluster) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, plan in plans.items():
        case = build("gpt", **cfg["model"])
        batch = case.make_batch(0, cfg["batch"])
        try:  # building fails the same way on every rank (validation, passes), so no rank hangs
            pm = parallelize(case.model, example_inputs=batch, loss_fn=case.loss_fn, plan=plan, cluster=cluster,
                             optimizer=functools.partial(torch.optim.Adam, lr=1e-3))
        except Exception as e:  # noqa: BLE001 - reported in the table, the other plans still run
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
            dist.barrier()
            continue
        for step in range(cfg["warmup"]):
            pm.train_step(case.make_batch(step, cfg["batch"]))
        times, records, calls = [], [], []
        cpu_in = CpuIn(pm)
        for step in range(cfg["steps"]):
            b = case.make_batch(100 + step, cfg["batch"])
            dist.barrier()
            RECORDER.timings = []
            cpu_in.reset()
            cpu0, cores0 = cpu_s(), core_times()
            start = time.perf_counter()
            loss = pm.train_step(b)
            cpu = cpu_s() - cpu0
            dist.barrier()
            times.append(time.perf_counter() - start)
            cores1 = core_times()
            idle, steal = (cores1[0] - cores0[0], cores1[1] - cores0[1]) if cores0 and cores1 else (0.0, 0.0)
            RECORDER.timings = None
            calls += pm.last_waits
            waits: dict[str, float] = {}
            for _, axis, _, _, secs in pm.last_waits:
                waits[axis] = waits.get(axis, 0.0) + secs
            records.append({**pm.last_timing, "waits": waits, "cpu": cpu, "calls": len(pm.last_waits),
                            "cpu_wait": cpu_in.wait, "cpu_opt": cpu_in.opt, "idle": idle, "steal": steal})
        cpu_in.close()
        pm.train_step(case.make_batch(999, cfg["batch"]), measure_memory=True)
        peaks = pm.memory_report().measured
        out[name] = {"step_s": statistics.median(times), "times": times, "loss": loss,
                     "summary": rank_summary(records, calls),
                     "cpu_s": statistics.median(r["cpu"] for r in records),
                     "cpu_wait_s": statistics.median(r["cpu_wait"] for r in records),
                     "cpu_opt_s": statistics.median(r["cpu_opt"] for r in records),
                     "idle_s": statistics.median(r["idle"] for r in records),
                     "steal_s": statistics.median(r["steal"] for r in records),
                     "calls": statistics.median(r["calls"] for r in records),
                     "pp_index": pm.mesh.pp_index, "activations": peaks["activations"], "buffers": peaks["buffers"],
                     **state_bytes(pm)}
        pm.close()  # its gloo groups' threads would otherwise tax every later plan's steps
        del pm
    return out


def print_memory(rows: list[dict[str, Any]]) -> None:
    """Per plan and pipeline stage: activations and buffers (FSDP's gathered units, unsharded
    gradients) predicted / measured, MiB (the worst rank of the stage)."""
    mib = 2**20
    print(f"\nmemory per stage, MiB predicted/measured: {'plan':18s} stage  activations (err)   buffers")
    for row in rows:
        for m in row.get("memory", []):
            print(f"  {row['plan']:18s} {m['stage']:5d}  {m['pred_act'] / mib:6.2f}/{m['meas_act'] / mib:<6.2f} "
                  f"({_err(m['pred_act'], m['meas_act']):+4.0f}%)  {m['pred_buffers'] / mib:6.2f}/{m['meas_buffers'] / mib:<6.2f}")


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a of two rankings: (concordant - discordant) pairs over all pairs; ties count 0.
    Example: [1, 2, 3] against [1, 3, 2]: (2 - 1) / 3 = 0.33."""
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    if not pairs:
        return 1.0
    score = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) - sum((a[i] - a[j]) * (b[i] - b[j]) < 0
                                                                            for i, j in pairs)
    return score / len(pairs)


def print_terms(rows: list[dict[str, Any]], cluster: Cluster) -> None:
    """Per plan and term, predicted against measured milliseconds per step (``fairscale.closed_loop``'s
    Measurement: slowest rank, median step), and the ranks' CPU seconds per step over the cores."""
    cores = cluster.shared_cores or os.cpu_count() or 1
    print(f"\nper term, ms per step, predicted/measured (compute: slowest pipeline rank, with the runtime's host "
          f"work, predicted alone under host; waits: slowest rank); cpu: all ranks' CPU seconds per step / {cores} cores")
    head = (f"{'plan':18s} {'step':>11s} {'compute':>11s} {'tp':>11s} {'dp':>11s} {'p2p+bubble':>11s} "
            f"{'optimizer':>11s} {'host':>5s} {'cpu/cores':>9s} {'calls':>5s}")
    print(head)
    for row in rows:
        if "error" in row:
            continue
        p, m = row["terms"]["pred"], row["terms"]["meas"]

        def pair(a: float, b: float) -> str:
            return f"{a * 1e3:5.0f}/{b * 1e3:<5.0f}"
        cpu = sum(row["terms"]["cpu_s"]) / cores
        print(f"{row['plan']:18s} {pair(p['step_s'], m['step_s'])} "
              f"{pair(max(p['stage_compute_s']), max(m['stage_compute_s']))} "
              + " ".join(pair(p['comm_s'].get(t, 0.0), m['comm_s'].get(t, 0.0)) for t in ("tp", "dp", "p2p"))
              + f" {pair(p['optimizer_s'], m['optimizer_s'])} {p.get('host_s', 0.0) * 1e3:5.0f} {cpu * 1e3:9.0f} "
              f"{max(row['terms']['calls']):5.0f}")
    print(f"\nCPU per term: the ranks' CPU seconds per step over the {cores} cores (what a CPU-bound step "
          f"takes), predicted (mean over ranks of the model's busy terms) / measured, ms")
    print("(idle: the cores' idle seconds per step over the cores, Cluster.core_idle of the CPU work; total excludes "
          "it; steal: what the hypervisor took, not modelled; wall: the step as timed)")
    print(f"{'plan':18s} {'compute':>11s} {'(host)':>6s} {'comm waits':>11s} {'optimizer':>11s} {'total':>11s} "
          f"{'idle':>11s} {'steal':>5s} {'wall':>6s}")
    for row in rows:
        if "error" in row:
            continue
        p, t = row["terms"]["pred"], row["terms"]
        comp = statistics.mean(p["stage_compute_s"])
        comm = sum(p["comm_s"].get(k, 0.0) for k in ("tp", "dp", "ep"))
        cw, co = sum(t["cpu_wait_s"]) / cores, sum(t["cpu_opt_s"]) / cores
        total = sum(t["cpu_s"]) / cores

        def pair(a: float, b: float) -> str:
            return f"{a * 1e3:5.0f}/{b * 1e3:<5.0f}"
        print(f"{row['plan']:18s} {pair(comp, total - cw - co)} {p.get('host_s', 0.0) * 1e3:6.0f} {pair(comm, cw)} "
              f"{pair(p['optimizer_s'], co)} "
              f"{pair(p['step_s'] - p.get('idle_s', 0.0), total)} "
              f"{pair(p.get('idle_s', 0.0), statistics.mean(t.get('idle_s', [0.0])) / cores)} "
              f"{statistics.mean(t.get('steal_s', [0.0])) / cores * 1e3:5.0f} {row['meas_step_s'] * 1e3:6.0f}")


def predict(plan: Plan, graph: ModelGraph, cluster: Cluster, global_batch: int) -> Breakdown:
    return cost_plan(plan, graph, cluster, global_batch=global_batch, validate=False)


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas * 100 if meas else float("nan")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--calibrate", action="store_true", help="measure the CPU and write cpu_cluster.json")
    ap.add_argument("--cluster", type=Path, default=CLUSTER_JSON)
    ap.add_argument("--plans", default="", help="comma-separated subset of the grid (and/or 'searched')")
    ap.add_argument("--tiny", action="store_true", help="smoke test: tiny model, 1 step, few plans")
    ap.add_argument("--out", type=Path, default=None, help="write every number as JSON here")
    args = ap.parse_args(argv)
    if args.tiny:
        args.dim, args.layers, args.seq, args.vocab, args.steps, args.warmup = 32, 8, 16, 64, 1, 0
        args.plans = args.plans or "1x8x1 ddp,2x2x2 1f1b,searched"

    stored = json.loads(args.cluster.read_text()) if args.cluster.exists() else {}
    stale = bool(stored) and (stored.get("version", 1) != CALIBRATION_VERSION or not stored.get("runtime_measured"))
    if stale:
        print(f"{args.cluster} was measured by an older calibration or without the runtime's host terms: "
              "measuring again")
    if args.calibrate or not args.cluster.exists() or stale:
        cal = calibrate_cpu(args.ranks, runtime_host=measure_runtime_host)
        print(cal.table())
        if not args.tiny:
            save_calibration(cal, args.cluster)
        cluster = cal.cluster
    else:
        cluster = load_calibration(args.cluster)
        if cluster.devices != args.ranks:
            sys.exit(f"{args.cluster} is for {cluster.devices} ranks; rerun with --calibrate for {args.ranks}")
    model_cfg = dict(dim=args.dim, layers=args.layers, heads=args.heads, seq=args.seq, vocab=args.vocab)
    case = build("gpt", **model_cfg)
    batch = case.make_batch(0, args.batch)
    graph = captured(case.model, batch, loss_fn=case.loss_fn)
    wanted = [p.strip() for p in args.plans.split(",") if p.strip()] or [*GRID, SEARCHED]
    plans: dict[str, Plan] = {}
    for name in wanted:
        if name == SEARCHED:
            t0 = time.perf_counter()
            res = search(case.model, batch, devices=args.ranks, cluster=cluster, loss_fn=case.loss_fn)
            print(f"search: {time.perf_counter() - t0:.2f} s\n{res.table()}\n")
            plans[SEARCHED] = res.plan
        elif name in GRID:
            plans[name] = hand_plan(graph, GRID[name], args.batch)
        else:
            sys.exit(f"unknown plan {name!r}; the grid has {', '.join(GRID)} and {SEARCHED}")
    predicted = {name: predict(plan, graph, cluster, args.batch) for name, plan in plans.items()}
    cfg = {"model": model_cfg, "batch": args.batch, "steps": args.steps, "warmup": args.warmup}
    load = os.getloadavg()
    t0 = time.perf_counter()
    ranks = fairscale.launch(run_plans, devices=args.ranks, args=(cfg, plans, cluster), timeout_s=3600)
    wall = time.perf_counter() - t0

    rows = []
    for name, plan in plans.items():
        b = predicted[name]
        failed = next((r[name]["error"] for r in ranks if "error" in r[name]), None)
        if failed:
            rows.append({"plan": name, "error": failed})
            continue
        meas_step = max(r[name]["step_s"] for r in ranks)
        by_stage: dict[int, dict[str, float]] = {}
        for r in ranks:
            m = r[name]
            cur = by_stage.setdefault(m["pp_index"], {"states": 0.0, "activations": 0.0, "buffers": 0.0})
            cur["states"] = max(cur["states"], m["parameters"] + m["gradients"] + m["optimizer"])
            cur["activations"] = max(cur["activations"], m["activations"])
            cur["buffers"] = max(cur["buffers"], m["buffers"])
        mem_err = []
        for s, meas in sorted(by_stage.items()):
            parts = b.memory_parts[s]
            pred_states = parts["parameters"] + parts["gradients"] + parts["optimizer"]
            mem_err.append({"stage": s, "pred_states": pred_states, "meas_states": meas["states"],
                            "pred_act": parts["activations"], "meas_act": meas["activations"],
                            "pred_buffers": parts["buffers"], "meas_buffers": meas["buffers"]})
        mesh = RankMesh(plan.mesh.pp, plan.mesh.dp, plan.mesh.tp, 0)
        terms = {"pred": predicted_terms(b, plan), "meas": dataclasses.asdict(measure([r[name]["summary"] for r in ranks], mesh)),
                 "cpu_s": [r[name]["cpu_s"] for r in ranks], "calls": [r[name]["calls"] for r in ranks],
                 "cpu_wait_s": [r[name]["cpu_wait_s"] for r in ranks], "cpu_opt_s": [r[name]["cpu_opt_s"] for r in ranks],
                 "idle_s": [r[name]["idle_s"] for r in ranks], "steal_s": [r[name]["steal_s"] for r in ranks]}
        rows.append({"plan": name, "mesh": f"{plan.mesh.pp}x{plan.mesh.dp}x{plan.mesh.tp}", "terms": terms,
                     "schedule": f"{plan.schedule.kind} m={plan.schedule.microbatches}",
                     "dp_kind": plan.data_parallel.kind, "recompute": plan.recompute,
                     "pred_step_s": b.step_time_s, "meas_step_s": meas_step, "memory": mem_err,
                     "loss": ranks[0][name]["loss"]})

    print(f"\nGPT {model_cfg}, global batch {args.batch}, {args.ranks} gloo ranks; "
          f"median of {args.steps} steps after {args.warmup} warm-up; launch wall {wall:.1f} s")
    print(f"cluster: {cluster.device}: {cluster.peak_flops['fp32'] / 1e9:.2f} GFLOP/s, "
          f"{cluster.hbm_bandwidth / 1e9:.2f} GB/s memory, link alpha {cluster.intra_latency * 1e6:.0f} us "
          f"beta {cluster.intra_bandwidth / 1e9:.3f} GB/s")
    head = (f"{'plan':18s} {'mesh':6s} {'schedule':10s} {'dp':6s} {'pred s':>8s} {'meas s':>8s} {'err':>6s}   "
            f"{'states MiB pred/meas (err)':>28s}   {'act MiB pred/meas (err)':>26s}")
    print(head)
    print("-" * len(head))
    mib = 2**20
    for row in rows:
        if "error" in row:
            print(f"{row['plan']:18s} FAILED to build: {row['error'][:140]}")
            continue
        worst = max(row["memory"], key=lambda m: m["meas_states"] + m["meas_act"])
        print(f"{row['plan']:18s} {row['mesh']:6s} {row['schedule']:10s} {row['dp_kind']:6s} "
              f"{row['pred_step_s']:8.3f} {row['meas_step_s']:8.3f} {_err(row['pred_step_s'], row['meas_step_s']):+5.0f}%   "
              f"{worst['pred_states'] / mib:9.2f} /{worst['meas_states'] / mib:8.2f} ({_err(worst['pred_states'], worst['meas_states']):+4.0f}%)   "
              f"{worst['pred_act'] / mib:8.2f} /{worst['meas_act'] / mib:8.2f} ({_err(worst['pred_act'], worst['meas_act']):+4.0f}%)")
    print_memory(rows)
    print_terms(rows, cluster)
    summary: dict[str, Any] = {}
    hand = [r for r in rows if r["plan"] != SEARCHED and "error" not in r]
    chosen = next((r for r in rows if r["plan"] == SEARCHED and "error" not in r), None)
    if hand:
        best = min(hand, key=lambda r: r["meas_step_s"])
        pred_best = min(hand, key=lambda r: r["pred_step_s"])
        print(f"\nbest hand-picked (measured): {best['plan']} {best['meas_step_s']:.3f} s; "
              f"the cost model ranks {pred_best['plan']} first among them")
        summary = {"best_hand": best["plan"], "best_hand_s": best["meas_step_s"]}
        if chosen is not None:
            ratio = chosen["meas_step_s"] / best["meas_step_s"]
            print(f"searched plan {chosen['mesh']} {chosen['schedule']} {chosen['dp_kind']}: "
                  f"{chosen['meas_step_s']:.3f} s; chosen / best hand-picked = {ratio:.3f} (goal <= 1.05)")
            summary.update(chosen_s=chosen["meas_step_s"], ratio=ratio)
        ok = [r for r in rows if "error" not in r]
        errs = [abs(_err(r["pred_step_s"], r["meas_step_s"])) for r in ok]
        tau = kendall_tau([r["pred_step_s"] for r in ok], [r["meas_step_s"] for r in ok])
        print(f"step-time error: median {statistics.median(errs):.0f}%, max {max(errs):.0f}%; Kendall tau of the "
              f"rankings {tau:.2f} (goals: 10%, 25%, 0.8); load average {load[0]:.1f} before the run, "
              f"{os.getloadavg()[0]:.1f} after, {os.cpu_count()} cores")
        cores = cluster.shared_cores or os.cpu_count() or 1
        cpu = [sum(r["terms"]["cpu_s"]) / cores for r in ok]
        tau_cpu = kendall_tau([r["pred_step_s"] for r in ok], cpu)
        print(f"against the ranks' CPU seconds over the cores (what other users' load does not stretch): "
              f"Kendall tau {tau_cpu:.2f}; predicted / CPU-bound ratio per plan: "
              + ", ".join(f"{r['plan']} {r['pred_step_s'] / c:.2f}" for r, c in zip(ok, cpu)))
        summary.update(median_err=statistics.median(errs), max_err=max(errs), tau=tau, tau_cpu=tau_cpu)
    result = {"config": {**cfg, "ranks": args.ranks}, "cluster": cluster.to_dict(), "machine": machine_description(),
              "rows": rows, "summary": summary, "plans": {k: p.to_dict() for k, p in plans.items()}}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


if __name__ == "__main__":
    main()
