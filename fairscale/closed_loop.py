"""The closed loop: measure the plan being run, refit the cost model to it, re-plan, switch live.

Usage::

    pm = fairscale.parallelize(model, example_inputs=batch, plan=plan, calibrate=5)
    for step in range(steps):
        pm.train_step(next_batch(step))     # after step 6 the plan may change under pm
    print(pm.closed_loop_report.text())     # what it measured, refitted and did

or ``python -m fairscale run --devices 4 --calibrate [--calibrate-steps K] train.py``.

What happens (:class:`ClosedLoop`, a ``pm.after_step`` hook on every rank):

1. The first ``train_step`` warms up (allocations, the batch check) and is not timed. The next
   ``K`` are: each rank's step and optimizer seconds (``pm.last_timing``), and every wait on a
   collective or a point-to-point batch from the flight record (``passes.ops.flight``, by op, axis,
   group size and bytes). Compute of a rank = step − optimizer − all waits.
2. The ranks share their timings and derive the same :class:`Measurement`: per term, the
   median over steps of the slowest rank (compute per pipeline rank; collectives by axis; point to
   point with the pipeline's idle waits; the optimizer).
3. Global rank 0 alone (the others get its decision: ``fairscale.runtime.startup.on_zero``)
   captures the model and :func:`refit` fits the cluster's coefficients to it. Compute: one plan's step gives one
   compute time per pipeline rank, and its mix of FLOPs, bytes and ops is nearly the same for
   every rank (backward ≈ 2× forward in all three), so the data determine one rate, not three:
   the least-squares factor ``k`` with measured ≈ predicted / k over the ranks, applied to peak
   FLOP/s and memory bandwidth (× k) and the host overhead per op (÷ k), keeping the calibrated
   ratios between them. Collectives: each distinct (op, group size, bytes) is one point
   (min over ranks of each rank's median: the rank that arrived last waited least for the
   others), with the ring formulas of ``planner.cost_comm`` giving its latency and byte terms;
   with message sizes spread at least 4×, α and β are both fitted
   (``fairscale.runtime.calibrate.fit_alpha_beta``), else only the term that dominates them
   (β for large messages, α for small), the other kept. A collective the cluster prices on a
   link of its own (calibrated CPU ranks' all-gather, reduce-scatter: ``Cluster.collective_ranges``)
   is refitted on it instead, by one factor from its own calls, and kept out of that fit.
4. It re-costs the current plan and searches again on the refitted cluster (the same search
   ``parallelize`` runs, every device used, the running plan's compute dtype kept); if the best plan is predicted at least
   :data:`SWITCH_GAIN` faster, ``fairscale.switch_plan`` reshards the training state in memory
   and ``pm`` continues under it (``pm.become``).

Limits: on CPU ranks that share cores, a pipeline rank computing while the others wait runs
faster than the all-busy rate the stage times assume, so ``k`` is biased high for pipelines with
large bubbles (it is common to all plans, so rankings move less than absolute times). The
optimizer and point-to-point terms are measured and shown but not refitted (the cluster has no
separate coefficient for them). Only ``train_step`` is timed (the plain ``pm(batch)`` loop is
not). On CUDA the timer synchronizes the device where it reads the clock. Until it has decided,
the loop holds the capture and the compile checker (to search again); then it lets them go.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

import torch.distributed as dist

from fairscale.runtime.calibrate import fit_alpha_beta
from fairscale.runtime.engine import ParallelModule
from fairscale.runtime.mesh import RankMesh
from fairscale.runtime.run_cli import ENV_CALIBRATE
from fairscale.runtime.startup import on_zero
from passes.ops.flight import RECORDER
from planner.cluster import Cluster, link_at
from planner.cost_comm import all_gather_time, all_reduce_time, all_to_all_time, reduce_scatter_time
from planner.plan import Plan
from planner.search import Breakdown, cost_plan

__all__ = ["ClosedLoop", "Measurement", "Fit", "ClosedLoopReport", "refit", "measure", "predicted_terms",
           "StepRecorder", "rank_summary", "term_table",
           "DEFAULT_STEPS", "SWITCH_GAIN"]

DEFAULT_STEPS = 5
"""Steps timed by ``calibrate=True`` (after one warm-up step)."""
SWITCH_GAIN = 0.10
"""Switch when another plan is predicted at least this much faster (10%): below that, the
refitted model's own error could reverse the order, and a switch costs a recompile."""
_TIME_OF: dict[str, Callable[..., float]] = {"all_reduce": all_reduce_time, "all_gather": all_gather_time,
                                             "reduce_scatter": reduce_scatter_time, "all_to_all": all_to_all_time}
_LABELS = {"tp": "tensor-parallel collectives", "dp": "data-parallel collectives", "ep": "expert all-to-all",
           "p2p": "pipeline send/receive + bubble"}
_AXIS_TERM = {"tp": "tp", "dp": "dp", "ep": "ep", "ep_rep": "dp", "pp": "p2p"}


@dataclass
class Measurement:
    """Seconds per step, the median over the timed steps of the slowest rank."""

    steps: int
    step_s: float
    optimizer_s: float
    stage_compute_s: list[float]
    """Per pipeline rank: step − optimizer − every wait (recompute included)."""
    comm_s: dict[str, float]
    """Term (``tp``, ``dp``, ``ep``, ``p2p``) -> exposed wait seconds; ``p2p`` includes the
    pipeline's idle waits (the bubble)."""
    calls: list[tuple[str, int, int, float]] = field(default_factory=list)
    """(op, group size, bytes, seconds) per distinct collective: the fitting points."""
    rank_step_s: list[float] = field(default_factory=list)
    """Per global rank: its median step time."""


@dataclass
class Fit:
    """What :func:`refit` changed, and from what."""

    compute_scale: float
    """k: the refitted compute rates over the calibrated ones (> 1: faster than calibrated)."""
    alpha_beta: dict[str, tuple[float, float]]
    """``intra`` / ``inter`` -> (latency s, bandwidth bytes/s) refitted; absent: kept."""
    how: list[str]


def _ring_terms(op: str, size: int, nbytes: int) -> tuple[float, float]:
    """(latency multiplier, bytes on the wire) of one collective in ``planner.cost_comm``'s formulas."""
    fn = _TIME_OF[op]
    return fn(nbytes, size, bandwidth=float("inf"), latency=1.0), fn(nbytes, size, bandwidth=1.0, latency=0.0)


def predicted_terms(b: Breakdown, plan: Plan) -> dict[str, Any]:
    """The cost model's figures for the terms :class:`Measurement` has (seconds per step); the
    compute of a pipeline rank includes the runtime's host work (``host_s``, also given alone)."""
    m, pp = plan.schedule.microbatches, plan.mesh.pp
    stages = [0.0] * pp
    for k, (f, bw) in enumerate(zip(b.stage_f_s, b.stage_b_s)):
        stages[k % pp] += m * (f + bw)
    if not b.stage_f_s:
        stages = [b.compute_s + b.recompute_s + b.tp_comm_s]
    stages = [max(0.0, s - b.tp_comm_s) for s in stages]  # stage times include exposed tp collectives
    # the runtime's host work is measured inside compute (step - waits - optimizer): add it to every
    # pipeline rank (it is the slowest rank's; ranks differ only by their dp tensors)
    stages = [s + b.host_s for s in stages]
    return {"step_s": b.step_time_s, "optimizer_s": b.optimizer_s, "stage_compute_s": stages, "host_s": b.host_s,
            "idle_s": b.idle_s, "comm_s": {"tp": b.tp_comm_s, "dp": b.dp_comm_s, "ep": b.ep_comm_s,
                       "p2p": b.p2p_s + b.bubble_s}}


def rank_summary(steps: list[dict[str, Any]], calls: list[tuple[str, str, int, int, float]]) -> dict[str, Any]:
    """One rank's timings, reduced to what the other ranks need."""
    points: dict[tuple[str, str, int, int], list[float]] = {}
    for op, axis, nbytes, size, secs in calls:
        points.setdefault((op, axis, size, nbytes), []).append(secs)
    return {"steps": steps, "points": {k: statistics.median(v) for k, v in points.items()}}


class StepRecorder:
    """One rank's per-term timings of chosen ``train_step`` calls, for :func:`measure` outside the
    closed loop (the demo, the end-to-end benchmark): ``start()`` before a step, ``stop(pm)`` after."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.calls: list[tuple[str, str, int, int, float]] = []

    def start(self) -> None:
        RECORDER.timings = []

    def stop(self, pm: ParallelModule) -> None:
        RECORDER.timings = None
        self.calls += pm.last_waits
        waits: dict[str, float] = {}
        for _, axis, _, _, secs in pm.last_waits:
            waits[axis] = waits.get(axis, 0.0) + secs
        self.records.append({**pm.last_timing, "waits": waits})

    def summary(self) -> dict[str, Any]:
        """What :func:`measure` takes from this rank (picklable)."""
        return rank_summary(self.records, self.calls)


def term_table(predicted: dict[str, Any], measured: Measurement) -> str:
    """Predicted (:func:`predicted_terms`) against measured seconds per step, term by term; a term
    measured only inside another says which."""
    rows: list[tuple[str, float, float | str]] = [("step", predicted["step_s"], measured.step_s)]
    rows += [(f"compute, pipeline rank {i}", p, m)
             for i, (p, m) in enumerate(zip(predicted["stage_compute_s"], measured.stage_compute_s))]
    for term, label in _LABELS.items():
        p, m = predicted["comm_s"].get(term, 0.0), measured.comm_s.get(term, 0.0)
        if p or m:
            rows.append((label, p, m))
    rows.append(("optimizer step", predicted["optimizer_s"], measured.optimizer_s))
    if predicted.get("host_s"):
        rows.append(("  of compute: runtime host", predicted["host_s"], "(in compute)"))
    if predicted.get("idle_s"):  # a rank sees idle cores as slower work and longer waits
        rows.append(("  of step: cores idle", predicted["idle_s"], "(in step)"))
    width = max(len(r[0]) for r in rows)
    out = [f"{'ms per step':<{width}} {'predicted':>10} {'measured':>10} {'error':>7}"]
    for label, p, m in rows:
        if isinstance(m, str):
            out.append(f"{label:<{width}} {p * 1e3:>10.1f} {m:>10}")
            continue
        err = f"{(p - m) / m * 100:+.0f}%" if m > 0 else ""
        out.append(f"{label:<{width}} {p * 1e3:>10.1f} {m * 1e3:>10.1f} {err:>7}")
    return "\n".join(out)


def measure(ranks: list[dict[str, Any]], mesh: RankMesh) -> Measurement:
    """The :class:`Measurement` of every rank's summary (``ranks[r]``, the same list on every rank)."""
    n = len(ranks[0]["steps"])
    step = statistics.median(max(r["steps"][i]["step"] for r in ranks) for i in range(n))
    opt = statistics.median(max(r["steps"][i]["optimizer"] for r in ranks) for i in range(n))
    stages = [0.0] * mesh.pp
    comm: dict[str, float] = {}
    for rank, r in enumerate(ranks):
        pp_index = mesh.coords(rank)[0]
        compute = statistics.median(s["step"] - s["optimizer"] - sum(s["waits"].values()) for s in r["steps"])
        stages[pp_index] = max(stages[pp_index], compute)
        terms: dict[str, list[float]] = {}
        for s in r["steps"]:
            per: dict[str, float] = {}
            for axis, secs in s["waits"].items():
                term = _AXIS_TERM.get(axis, axis)
                per[term] = per.get(term, 0.0) + secs
            for term, secs in per.items():
                terms.setdefault(term, []).append(secs)
        for term, values in terms.items():
            comm[term] = max(comm.get(term, 0.0), statistics.median(values + [0.0] * (n - len(values))))
    points: dict[tuple[str, int, int], float] = {}
    for r in ranks:
        for (op, axis, size, nbytes), secs in r["points"].items():
            if op in _TIME_OF and axis != "pp" and nbytes > 0:
                key = (op, size, nbytes)
                points[key] = min(points.get(key, float("inf")), secs)
    return Measurement(steps=n, step_s=step, optimizer_s=opt, stage_compute_s=stages, comm_s=comm,
                       calls=[(op, size, nbytes, t) for (op, size, nbytes), t in sorted(points.items())],
                       rank_step_s=[statistics.median(s["step"] for s in r["steps"]) for r in ranks])


def _own_links(cluster: Cluster, measured: Measurement, changes: dict[str, Any], how: list[str]) -> set[str]:
    """Refit the collectives the cluster prices on links of their own inside a node (calibrated CPU
    ranks: ``Cluster.collective_ranges`` / ``collective_links``) from their own measured calls: one
    factor per op, ``k`` = measured over predicted seconds summed over its calls, multiplying its
    latencies and dividing its bandwidths (every call's time × k), written into ``changes``. They
    stay out of the link's fit, which they never priced. Returns the ops refitted."""
    ops = set(cluster.collective_links) | set(cluster.collective_ranges)
    done = set()
    for op in sorted(ops & set(_TIME_OF)):
        calls = [(size, nbytes, t) for name, size, nbytes, t in measured.calls
                 if name == op and size <= cluster.devices_per_node]
        rows = cluster.link_rows(op)
        predicted = sum(_TIME_OF[op](nbytes, size, bandwidth=bw, latency=lat)
                        for size, nbytes, _ in calls for bw, lat in [link_at(rows, nbytes)])
        if not calls or predicted <= 0:
            continue
        spent = sum(t for _, _, t in calls)
        k = spent / predicted
        if op in cluster.collective_ranges:
            changes.setdefault("collective_ranges", dict(cluster.collective_ranges))[op] = tuple(
                (end, bw / k, lat * k) for end, bw, lat in cluster.collective_ranges[op])
        if op in cluster.collective_links:
            bw, lat = cluster.collective_links[op]
            changes.setdefault("collective_links", dict(cluster.collective_links))[op] = (bw / k, lat * k)
        how.append(f"{op}: measured {spent * 1e3:.3g} ms against {predicted * 1e3:.3g} ms "
                   f"predicted over {len(calls)} size(s) on its own calibrated link: its times × {k:.3g}")
        done.add(op)
    return done


def refit(cluster: Cluster, predicted: dict[str, Any], measured: Measurement) -> tuple[Cluster, Fit]:
    """``cluster`` with its compute rates and collective α/β fitted to ``measured`` (see the module
    docstring); ``predicted`` is :func:`predicted_terms` of the plan that was measured on ``cluster``."""
    how: list[str] = []
    pred, meas = predicted["stage_compute_s"], measured.stage_compute_s
    num = sum(p * p for p in pred)
    den = sum(p * t for p, t in zip(pred, meas))
    k = num / den if num > 0 and den > 0 else 1.0
    how.append(f"compute: measured {sum(meas) * 1e3:.3g} ms against {sum(pred) * 1e3:.3g} ms predicted over "
               f"{len(pred)} pipeline rank(s): rates × {k:.3g} (least squares, one common factor)")
    changes: dict[str, Any] = {
        "peak_flops": {d: f * k for d, f in cluster.peak_flops.items()},
        "hbm_bandwidth": cluster.hbm_bandwidth * k, "op_overhead_s": cluster.op_overhead_s / k}
    links: dict[str, tuple[float, float]] = {}
    eff = cluster.efficiency.network
    own = _own_links(cluster, measured, changes, how)
    for link, inside in (("intra", True), ("inter", False)):
        pts = [(*_ring_terms(op, size, nbytes), t) for op, size, nbytes, t in measured.calls
               if (size <= cluster.devices_per_node) == inside and not (inside and op in own)]
        if not pts:
            continue
        bandwidth, latency = cluster.link(1 if inside else cluster.devices_per_node + 1)
        beta0 = bandwidth * eff
        sizes = [xb for _, xb, _ in pts]
        if max(sizes) >= 4 * min(sizes) and len(pts) >= 2:
            alpha, beta, err = fit_alpha_beta(pts)
            how.append(f"{link}-node collectives: α {alpha * 1e6:.3g} us, β {beta / 1e9:.3g} GB/s fitted to "
                       f"{len(pts)} sizes (max error {err * 100:.0f}%)")
        elif sum(xl * latency for xl, _, _ in pts) >= sum(xb / beta0 for _, xb, _ in pts):
            alpha, beta = sum(max(0.0, t - xb / beta0) for xl, xb, t in pts) / sum(xl for xl, _, _ in pts), beta0
            how.append(f"{link}-node collectives: latency-bound messages of one size: α {alpha * 1e6:.3g} us "
                       f"fitted, β kept")
        else:
            spent = sum(max(1e-12, t - xl * latency) for xl, _, t in pts)
            alpha, beta = latency, sum(xb for _, xb, _ in pts) / spent
            how.append(f"{link}-node collectives: bandwidth-bound messages of one size: β {beta / 1e9:.3g} GB/s "
                       f"fitted, α kept")
        links[link] = (alpha, beta)
        changes[f"{link}_latency"], changes[f"{link}_bandwidth"] = alpha, beta / eff
        if inside and cluster.collective_call_s and latency > 0:
            # the calibrated per-call costs by group size follow the refitted latency in proportion
            changes["collective_call_s"] = {op: {g: t * alpha / latency for g, t in calls.items()}
                                            for op, calls in cluster.collective_call_s.items()}
    if not links:
        how.append("collectives: none measured, α and β kept")
    name = cluster.name if cluster.name.endswith("+refit") else cluster.name + "+refit"
    return dataclasses.replace(cluster, name=name, **changes), Fit(compute_scale=k, alpha_beta=links, how=how)


@dataclass
class ClosedLoopReport:
    """What the closed loop measured and did (``pm.closed_loop_report``, the same on every rank)."""

    measured: Measurement
    predicted: dict[str, Any]
    refit_predicted: dict[str, Any]
    fit: Fit
    current_s: float
    """The running plan's step time under the refitted model."""
    best_s: float
    best: Plan
    switched: bool
    decision: str

    def table(self) -> str:
        rows = [("step", self.predicted["step_s"], self.refit_predicted["step_s"], self.measured.step_s)]
        for i, (p, r, m) in enumerate(zip(self.predicted["stage_compute_s"], self.refit_predicted["stage_compute_s"],
                                          self.measured.stage_compute_s)):
            rows.append((f"compute, pipeline rank {i}", p, r, m))
        for term, label in _LABELS.items():
            p, r, m = (self.predicted["comm_s"].get(term, 0.0), self.refit_predicted["comm_s"].get(term, 0.0),
                       self.measured.comm_s.get(term, 0.0))
            if p or m:
                rows.append((label, p, r, m))
        rows.append(("optimizer step", self.predicted["optimizer_s"], self.refit_predicted["optimizer_s"],
                     self.measured.optimizer_s))
        width = max(len(r[0]) for r in rows)
        width = max(width, len("seconds per step"))
        out = [f"{'seconds per step':<{width}} {'predicted':>10} {'refit':>10} {'measured':>10} {'error':>7} "
               f"{'refit error':>11}"]
        for label, p, r, m in rows:
            err, rerr = (f"{(p - m) / m * 100:+.0f}%", f"{(r - m) / m * 100:+.0f}%") if m > 0 else ("", "")
            out.append(f"{label:<{width}} {p:>10.4g} {r:>10.4g} {m:>10.4g} {err:>7} {rerr:>11}")
        out.append("(slowest rank, median over the timed steps; error: predicted against measured)")
        if self.measured.rank_step_s:
            out.append("step per rank (s): " + " ".join(f"{t:.4g}" for t in self.measured.rank_step_s))
        return "\n".join(out)

    def text(self) -> str:
        return "\n".join([f"closed loop: {self.measured.steps} steps timed", self.table(), *self.fit.how,
                          self.decision])


class ClosedLoop:
    """Time ``steps`` steps of ``pm`` after one warm-up, refit, re-plan and maybe switch (module docstring).

    ``replan(cluster) -> Plan`` searches on the refitted cluster; ``switch(pm, plan, cluster)``
    is ``fairscale.switch_plan``; ``graph_of()`` gives the annotated capture plans are costed on
    (called on global rank 0 only, which refits and re-plans for every rank)."""

    def __init__(self, steps: int, *, graph_of: Callable[[], Any], cluster: Cluster,
                 replan: Callable[[Cluster], Plan], switch: Callable[[ParallelModule, Plan, Cluster], ParallelModule],
                 out: TextIO | None = None) -> None:
        if steps < 1:
            raise ValueError(f"calibrate={steps}: time at least one step (calibrate=True times {DEFAULT_STEPS})")
        self.steps = steps
        self.graph_of = graph_of
        self.cluster = cluster
        self.replan = replan
        self.switch = switch
        self.out = out if out is not None else sys.stdout
        self.seen = 0
        self.records: list[dict[str, Any]] = []
        self.calls: list[tuple[str, str, int, int, float]] = []

    def attach(self, pm: ParallelModule) -> None:
        pm.after_step.append(self)
        pm.sync_timing = True

    def __call__(self, pm: ParallelModule, loss: float) -> None:
        self.seen += 1
        if self.seen > 1:
            self.calls += pm.last_waits
            waits: dict[str, float] = {}
            for _, axis, _, _, secs in pm.last_waits:
                waits[axis] = waits.get(axis, 0.0) + secs
            self.records.append({**pm.last_timing, "waits": waits})
        if self.seen <= self.steps:
            RECORDER.timings = []  # time the next step's waits (pm.last_waits)
            return
        RECORDER.timings = None
        pm.after_step.remove(self)
        pm.sync_timing = False
        pm.closed_loop_report = self.finish(pm)

    def finish(self, pm: ParallelModule) -> ClosedLoopReport:
        """Share the timings; refit and re-plan on rank 0 and send every rank the decision; switch
        ``pm`` if it pays. Collective."""
        summaries: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(summaries, rank_summary(self.records, self.calls))
        measured = measure(summaries, pm.mesh)
        report, cluster = on_zero(lambda: self.decide(pm.plan, measured),
                                  "re-planning under the refitted cost model (rank 0)")
        if dist.get_rank() == 0:
            print(report.text(), file=self.out, flush=True)
        if report.switched:
            pm.become(self.switch(pm, report.best, cluster))
        return report

    def decide(self, plan: Plan, measured: Measurement) -> tuple[ClosedLoopReport, Cluster]:
        """Refit the cost model to ``measured``, re-plan, and say whether to switch from ``plan``;
        with the refitted cluster."""
        graph = self.graph_of()
        before = cost_plan(plan, graph, self.cluster)
        predicted = predicted_terms(before, plan)
        cluster, fit = refit(self.cluster, predicted, measured)
        current = cost_plan(plan, graph, cluster)
        best = self.replan(cluster)
        best_s = cost_plan(best, graph, cluster).step_time_s
        same = best.to_dict() | {"predicted": None, "cluster": None} == plan.to_dict() | {"predicted": None,
                                                                                         "cluster": None}
        gain = 1 - best_s / current.step_time_s if current.step_time_s > 0 else 0.0
        switch = not same and gain >= SWITCH_GAIN
        m = plan.mesh
        if same:
            decision = f"kept pp{m.pp}×dp{m.dp}×tp{m.tp}: the search picks it again under the refitted model"
        elif not switch:
            decision = (f"kept pp{m.pp}×dp{m.dp}×tp{m.tp} ({current.step_time_s:.4g} s/step refitted): the best "
                        f"other plan is {gain * 100:.1f}% faster, under the {SWITCH_GAIN * 100:.0f}% it takes to switch")
        else:
            b = best.mesh
            decision = (f"switched live from pp{m.pp}×dp{m.dp}×tp{m.tp} ({current.step_time_s:.4g} s/step refitted) "
                        f"to pp{b.pp}×dp{b.dp}×tp{b.tp} (predicted {best_s:.4g} s/step, {gain * 100:.0f}% faster) "
                        f"after step {self.seen}")
        report = ClosedLoopReport(measured=measured, predicted=predicted,
                                  refit_predicted=predicted_terms(current, plan), fit=fit,
                                  current_s=current.step_time_s, best_s=best_s, best=best, switched=switch,
                                  decision=decision)
        return report, cluster


def steps_requested(calibrate: bool | int | None, environ: dict[str, str]) -> int:
    """Timed steps for ``parallelize(calibrate=...)``: False/0 none, True :data:`DEFAULT_STEPS`,
    K itself; None reads ``FAIRSCALE_CALIBRATE`` (what ``fairscale run --calibrate`` sets)."""
    if calibrate is None:
        raw = environ.get(ENV_CALIBRATE, "")
        return int(raw) if raw.strip() else 0
    if calibrate is True:
        return DEFAULT_STEPS
    if calibrate is False:
        return 0
    if isinstance(calibrate, int) and calibrate >= 1:
        return calibrate
    raise ValueError(f"calibrate={calibrate!r}: give True, False or a number of steps to time (>= 1)")

