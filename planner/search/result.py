"""Search results: the winning plan, runners-up with why they lost, and the infeasible message."""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.cost_memory import model_state_bytes
from planner.graph import ModelGraph
from planner.plan import DataParallel, Mesh, ModelRef, Plan, PlanError, Schedule, Stage, TensorParallel
from planner.schedule_kinds import KINDS
from planner.search.config import STEP_TERMS, Breakdown, Config, Context
from planner.selectors import format_layers

__all__ = ["Candidate", "SearchResult", "NoFeasiblePlan", "NoCompilablePlan", "build_plan", "loss_reason",
           "infeasible_message"]

GiB = float(2**30)


@dataclass(kw_only=True)
class Candidate:
    """One costed plan."""

    plan: Plan
    """The plan, with ``predicted`` filled in."""
    breakdown: Breakdown
    """Where its step time and memory go."""
    reason: str = ""
    """For a runner-up: one line on why it lost to the winner (empty for the winner)."""
    refused: str = ""
    """Why the compile check refused the plan (``search(compiles=...)``); empty when it compiled
    or was not checked."""
    checked: bool = True
    """False for a runner-up the compile check skipped (``search(check_runners_up=False)``, what
    ``fairscale.plan``, ``parallelize`` and ``fairscale plan`` ask: they use the winner only, and
    any plan is checked again before it runs)."""

    def summary(self) -> str:
        b, c = self.breakdown, self.breakdown.config
        assert c is not None
        sched = KINDS[c.kind].label(c.v)
        dp = c.dp_kind + ("" if c.dp_kind != "fsdp" else ("+reshard" if c.reshard else "+keep"))
        dp += "+offload" if c.offload else ""
        rec = f"recompute {len(c.recompute)}" if c.recompute else "no recompute"
        rec += f", selective {len(c.selective)}" if c.selective else ""
        mesh = f"pp={c.pp} dp={c.dp} tp={c.tp}" + (f" ep={c.ep}" if c.ep > 1 else "") + (" sp" if c.sp else "")
        units = f" units {c.units}" if c.units else ""
        idle = f" on {b.devices} of {b.cluster_devices} devices" if b.cluster_devices > b.devices else ""
        return (f"{mesh} {sched} m={c.microbatches} {dp}{units} {c.param_dtype} {rec}{idle}: "
                f"{b.step_time_s:.4g} s/step, {b.tflops_per_device:.3g} TFLOP/s/device "
                f"(MFU {100 * b.mfu:.0f}%, HFU {100 * b.hfu:.0f}%), "
                f"{max(b.memory_bytes) / GiB:.3g} GiB peak, {b.comm_bytes / GiB:.3g} GiB sent/device")


@dataclass(kw_only=True)
class SearchResult:
    """The best plan and the runners-up, best first."""

    best: Candidate
    """The winner."""
    runners_up: list[Candidate] = field(default_factory=list)
    """The next best plans (one per mesh shape), each with the reason it lost."""
    considered: int = 0
    """Configurations enumerated."""
    refused: list[Candidate] = field(default_factory=list)
    """Plans the compile check refused (``search(compiles=...)``), in the order they were
    checked, each with ``refused`` set; their meshes were given up for the next."""
    evaluated: int = 0
    """Configurations whose stages were cut and costed (the rest were pruned by a lower bound)."""
    elapsed_s: float = 0.0
    """Wall time of the search."""

    @property
    def plan(self) -> Plan:
        return self.best.plan

    def table(self) -> str:
        lines = [f"best:  {self.best.summary()}"]
        for i, c in enumerate(self.runners_up, 1):
            unchecked = "" if c.checked else " (compile check not run)"
            lines.append(f"#{i + 1}:    {c.summary()}{unchecked}\n       lost: {c.reason}")
        for c in self.refused:
            why = c.refused.replace("\n", "\n       ")
            lines.append(f"refused: {c.summary()}\n       {why}")
        lines.append(f"({self.considered} configurations, {self.evaluated} costed in full, {self.elapsed_s:.2f} s)")
        return "\n".join(lines)


class NoFeasiblePlan(PlanError):
    """No configuration fits in device memory; the message gives the smallest shortfall and the fixes."""

    def __init__(self, message: str, *, shortfall_bytes: float) -> None:
        self.shortfall_bytes = shortfall_bytes
        super().__init__([message], source="search")


class NoCompilablePlan(PlanError):
    """Every plan that fits was refused by the compile check; ``refused`` holds them with the reasons."""

    def __init__(self, refused: list[Candidate]) -> None:
        self.refused = refused
        head = (f"every plan that fits in memory was refused before launch: all {len(refused)} candidate(s) "
                "(each mesh's best; a refused mesh is given up whole)")
        reasons = {c.refused for c in refused}
        if len(reasons) == 1 and len(refused) > 1:  # the model's loss, say: the reason once, not once per mesh
            meshes = "; ".join(c.summary() for c in refused[:8]) + (" ..." if len(refused) > 8 else "")
            lines = [head, f"{meshes}: all for one reason: {reasons.pop()}"]
        else:
            lines = [head] + [f"{c.summary()}: {c.refused}" for c in refused[:8]]
            if len(refused) > 8:
                lines.append(f"... and {len(refused) - 8} more")
        super().__init__(lines, source="search")


def build_plan(graph: ModelGraph, ctx: Context, cfg: Config, breakdown: Breakdown, *,
               tp_rules: dict[str, str], units: str | None) -> Plan:
    """A Plan that spells out ``cfg`` with selectors, and its prediction."""
    names = [f.name for f in ctx.facts]
    stages = []
    if cfg.pp * cfg.v > 1:
        stages = [Stage(layers=format_layers(names[a:b])) for a, b in zip(cfg.cuts, cfg.cuts[1:])]
    recompute = {format_layers([names[i] for i in sorted(cfg.recompute)]): "full"} if cfg.recompute else {}
    if cfg.selective:
        recompute[format_layers([names[i] for i in sorted(cfg.selective)])] = "selective"
    fsdp = cfg.dp_kind == "fsdp"
    dp = DataParallel(kind=cfg.dp_kind, units=(units or _block_selector(ctx)) if fsdp else "",
                      reshard_after_forward=cfg.reshard if fsdp else True, param_dtype=cfg.param_dtype,
                      offload=cfg.offload,
                      reduce_dtype=cfg.reduce_dtype, prefetch=cfg.prefetch if fsdp else True,
                      bucket_mb=25.0 if fsdp else cfg.bucket_mb)
    pred = breakdown.predicted
    return Plan(model=ModelRef(class_=graph.model_class, fingerprint=graph.fingerprint,
                               parameters=graph.num_parameters),
                cluster=ctx.cluster.to_dict(), mesh=Mesh(pp=cfg.pp, dp=cfg.dp, tp=cfg.tp, ep=cfg.ep),
                schedule=Schedule(kind=cfg.kind, microbatches=cfg.microbatches, virtual_stages=cfg.v,
                                  global_batch=ctx.global_batch),
                stages=stages,
                tensor_parallel=TensorParallel(rules=dict(tp_rules) if cfg.tp > 1 else {}, sequence_parallel=cfg.sp),
                data_parallel=dp, recompute=recompute, predicted=pred)


def _block_selector(ctx: Context) -> str:
    blocks = sorted({f.block for f in ctx.facts if f.block})
    if blocks:
        return ", ".join(blocks)
    return format_layers([f.name for f in ctx.facts])


def loss_reason(b: Breakdown, w: Breakdown) -> str:
    """One line: how much slower ``b`` is than the winner ``w``, and the term that grew most."""
    pct = 100.0 * (b.step_time_s / w.step_time_s - 1.0)
    terms = {label: (getattr(b, name), getattr(w, name)) for name, label in STEP_TERMS}
    name, (x, y) = max(terms.items(), key=lambda kv: (kv[1][0] - kv[1][1], kv[0]))
    if pct <= 0.05:
        return f"ties the winner ({b.step_time_s:.4g} s); the winner came first in the search order"
    extra = ""
    if name == "pipeline bubble":
        extra = f" ({100 * b.bubble:.1f}% vs {100 * w.bubble:.1f}% of the pipeline)"
    return (f"{pct:.1f}% slower ({b.step_time_s:.4g} s vs {w.step_time_s:.4g} s), mostly {name}: "
            f"{x:.3g} s vs {y:.3g} s{extra}")


def infeasible_message(ctx: Context, closest: Breakdown | None, *, total_params: int, param_dtype: str,
                       fixed_notes: list[str], offloaded: Candidate | None = None) -> tuple[str, float]:
    """The error text when nothing fits, and the smallest shortfall in bytes."""
    cap = ctx.cap
    c = ctx.cluster
    states = model_state_bytes(float(total_params), dp_kind="ddp", dp=1, param_dtype=param_dtype,
                               optimizer=ctx.options.optimizer)
    need = max(1, int(-(-states // cap)))
    nodes = -(-need // c.devices_per_node)
    lines = []
    if closest is not None and closest.config is not None:
        cfg = closest.config
        short = closest.shortfall
        worst = max(closest.memory_bytes)
        lines.append(f"no plan fits in memory on {c.devices} × {c.device}: the closest, pp={cfg.pp} dp={cfg.dp} "
                     f"tp={cfg.tp} {cfg.dp_kind}{' with full recompute' if cfg.recompute else ''}, needs "
                     f"{worst / GiB:.1f} GiB on its fullest device, {short / GiB:.1f} GiB over the "
                     f"{cap / GiB:.1f} GiB usable ({c.memory_bytes / GiB:.1f} GiB × "
                     f"{ctx.options.usable_memory_fraction:g})")
    else:
        short = states / c.devices - cap
        lines.append(f"no plan fits in memory on {c.devices} × {c.device}: parameters, gradients and Adam states "
                     f"alone are {states / GiB:.1f} GiB, {states / c.devices / GiB:.1f} GiB per device even fully "
                     f"sharded, over the {cap / GiB:.1f} GiB usable")
    fixes = [f"more devices (model states alone need at least {need} devices = {nodes} node(s) of "
             f"{c.devices_per_node} when fully sharded)"]
    fixes.extend(fixed_notes)
    fixes.append("full recompute of every block and fsdp sharding (both already tried unless a constraint "
                 "fixed them)")
    fixes.append("a smaller global batch or microbatch (activations scale with it)")
    if offloaded is not None:
        fixes.append(f"offload to the CPU, which fits: {offloaded.summary()} (constraints "
                     '{"data_parallel": {"kind": "fsdp", "offload": true}})')
    else:
        fixes.append("offload to the CPU (data_parallel.offload; with these constraints it does not fit either)")
    return lines[0] + ". To make it fit: " + "; or ".join(fixes) + ".", max(0.0, short)
