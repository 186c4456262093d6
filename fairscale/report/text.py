"""The plan's text report: mesh, schedule, stages with their layers, memory, predicted time, collectives.

    print(render_report(plan, graph))      # graph (optional) adds parameter counts per stage
"""

from __future__ import annotations

from planner.batch_stats import describe_ops, find_batch_stat_ops
from planner.graph import ModelGraph
from planner.plan import Plan, Stage
from planner.schedule_kinds import KINDS
from planner.selectors import SelectorError, format_layers, parse_selector, stage_layers

__all__ = ["render_report"]

def render_report(plan: Plan, graph: ModelGraph | None) -> str:
    """The plan as a readable table: mesh, schedule, stages with their layers and parameter counts,
    per-device memory, predicted step time and collectives per step (what the plan holds)."""
    m, s, dp = plan.mesh, plan.schedule, plan.data_parallel
    lines = [f"plan for {plan.model.class_ or '(unnamed model)'}"
             + (f" (fingerprint {plan.model.fingerprint}, {plan.model.parameters:,} parameters)"
                if plan.model.fingerprint else ""),
             f"mesh: pp({m.pp}) × dp({m.dp}) × tp({m.tp}) = {m.size} devices"
             + (f"; MoE experts split over ep({m.ep}) of the dp ranks" if m.ep > 1 else ""),
             f"schedule: {s.kind}, {s.microbatches} microbatch{'es' if s.microbatches != 1 else ''}"
             + (f", {s.virtual_stages} model chunks per rank" if s.virtual_stages > 1 else ""),
             f"data parallel: {dp.kind}, params {dp.param_dtype}, gradients reduced in {dp.reduce_dtype}"
             + (f", units {dp.units}, {'reshard' if dp.reshard_after_forward else 'keep'} after forward"
                if dp.kind == "fsdp" else f", {dp.bucket_mb:g} MiB buckets")
             + (", offloaded to CPU" if dp.offload else "")]
    tp = plan.tensor_parallel
    if tp.rules:
        lines.append("tensor parallel" + (" (sequence parallel)" if tp.sequence_parallel else "") + ":")
        lines.extend(f"  {k:<40} {v}" for k, v in tp.rules.items())
    else:
        lines.append("tensor parallel: none")
    if plan.recompute:
        lines.append("recompute:")
        lines.extend(f"  {k:<40} {v}" for k, v in plan.recompute.items())
    else:
        lines.append("recompute: none")
    lines.extend(_batch_norm(plan, graph))
    lines.append("")
    lines.extend(_stage_table(plan, graph))
    lines.append("")
    lines.extend(_predictions(plan))
    return "\n".join(lines)


def _batch_norm(plan: Plan, graph: ModelGraph | None) -> list[str]:
    """How the model's batch statistics are taken (nothing for a model without any)."""
    ops = find_batch_stat_ops(graph.gm) if graph is not None else []
    if graph is not None and not ops:
        return []
    if plan.batch_norm == "local":
        return ["batch norm: local (opted in): each dp rank and microbatch normalizes with its own batch statistics "
                "and updates the running statistics once per microbatch, like torch DDP without SyncBatchNorm; "
                "losses and running statistics differ from one process's"
                + (f": {describe_ops(ops)}" if ops else "")]
    if not ops:
        return []
    return [f"batch norm: sync: statistics over the dp group's global batch, as one process computes them: "
            f"{describe_ops(ops)}"]


def _placement(plan: Plan, stages: int) -> list[int]:
    """Pipeline rank of each stage, as the schedule kind places them (interleaved and V differ)."""
    pp, v = plan.mesh.pp, plan.schedule.virtual_stages
    kind = KINDS.get(plan.schedule.kind)
    if pp <= 1:
        return [0] * stages
    if kind is None or kind.chunk_problem(v) is not None or pp * v != stages:
        return [i % pp for i in range(stages)]
    return kind.placement(pp, v)


def _stage_table(plan: Plan, graph: ModelGraph | None) -> list[str]:
    memory = plan.predicted.memory_gib
    stages = plan.stages or [Stage(layers="**")]
    rows = [("stage", "pp rank", "layers", "params", "rank memory GiB")]
    placement = _placement(plan, len(stages))
    held = _held_layers(stages, graph)
    for i, stage in enumerate(stages):
        r = placement[i]
        mem = f"{memory[r]:.3g}" if r < len(memory) else "-"
        rank = str(r)
        groups = [(stage.layers, "-")] if held is None or graph is None else _layer_groups(held[i], graph)
        for j, (names, params) in enumerate(groups):
            rows.append((str(i) if j == 0 else "", rank if j == 0 else "", names, params, mem if j == 0 else ""))
        if held is not None and graph is not None and len(groups) > 1:
            rows.append(("", "", "  total", f"{sum(graph.layer(n).param_count for n in held[i]):,}", ""))
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    out = []
    for r in rows:
        out.append(f"{r[0]:>{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>{widths[3]}}  "
                   f"{r[4]:>{widths[4]}}".rstrip())
    return out


def _held_layers(stages: list[Stage], graph: ModelGraph | None) -> list[list[str]] | None:
    """Each stage's layers as the passes split them (``planner.selectors.stage_layers``: a layer a
    stage matches only by a suffix, such as ResNet's ``conv1`` in ``layer3.0.conv1``, is held by the
    stage that names it whole), or None without a graph or with a selector that does not parse."""
    if graph is None:
        return None
    try:
        return stage_layers([parse_selector(s.layers) for s in stages], [layer.name for layer in graph.layers])
    except SelectorError:
        return None


def _layer_groups(names: list[str], graph: ModelGraph) -> list[tuple[str, str]]:
    """(names, params) rows for a stage's layers: runs of one repeated block fold into one row."""
    rows: list[tuple[str, str]] = []
    run: list[str] = []

    def flush() -> None:
        if not run:
            return
        counts = {graph.layer(n).param_count for n in run}
        each = counts.pop() if len(counts) == 1 else None
        params = (f"{len(run)} × {each:,}" if len(run) > 1 else f"{each:,}") if each is not None else \
            f"{sum(graph.layer(n).param_count for n in run):,}"
        if params == "0" and any(graph.layer(n).params for n in run):
            params = "0 (tied)"  # its parameters are counted where they are first used
        rows.append((format_layers(run), params))
        run.clear()

    for name in names:
        if run and _block_of(name) != _block_of(run[-1]):
            flush()
        run.append(name)
        if _block_of(name) is None:
            flush()
    flush()
    return rows


def _block_of(name: str) -> str | None:
    head, _, last = name.rpartition(".")
    return head if last.isdigit() else None


def _costed_for(plan: Plan) -> list[str]:
    """Which hardware figures the predictions rest on: a preset's datasheet, the detected GPUs, or
    this machine's CPU ranks measured (``fairscale calibrate``) or not."""
    c = plan.cluster
    if not c:
        return []
    name, device = c.get("name", "?"), c.get("device", "?")
    if name == "cpu-calibrated":
        return [f"costed for {device}: rates measured on this machine (fairscale calibrate re-measures)"]
    if name == "cpu":
        return ["costed for CPU ranks with default rates, not measured here (run `fairscale calibrate`)"]
    if name == "detected-calibrated":
        return [f"costed for {device}: GEMM rates and memory bandwidth measured on this GPU (fairscale calibrate "
                "re-measures); links between GPUs from the datasheet"]
    return [f"costed for {name}: {device}"]


def _predictions(plan: Plan) -> list[str]:
    p, m, s = plan.predicted, plan.mesh, plan.schedule
    lines = []
    if p.step_time_s > 0:
        peak = f", peak memory {max(p.memory_gib):.3g} GiB/device" if p.memory_gib else ""
        lines.append(f"predicted: {p.step_time_s:.4g} s/step, {p.tflops_per_device:.3g} TFLOP/s per device{peak}, "
                     f"pipeline bubble {100 * p.bubble:.1f}%")
        if p.mfu or p.hfu:
            lines.append(f"utilization: MFU {100 * p.mfu:.1f}% (model FLOPs), HFU {100 * p.hfu:.1f}% (with recompute, "
                         f"{p.hardware_tflops_per_device:.3g} TFLOP/s per device)")
        lines.extend(p.notes)
        lines.extend(_costed_for(plan))
        lines.append(f"collectives per step: {p.comm_gib_per_step:.3g} GiB sent per device")
    else:
        lines.append("predicted: none (this plan was not costed; planner.search fills these in)")
        lines.append("collectives per step:")
    # What the plan's structure implies, whatever the cost model says.
    if m.pp > 1:
        sends = 2 * (m.pp * s.virtual_stages - 1) * s.microbatches
        cuts = m.pp * s.virtual_stages - 1
        lines.append(f"  pp: {sends} point-to-point sends per pipeline replica (activations forward, gradients "
                     f"backward, at {cuts} cut{'s' if cuts > 1 else ''} × {s.microbatches} microbatch"
                     f"{'es' if s.microbatches > 1 else ''})")
    if m.dp > 1:
        kind = plan.data_parallel.kind
        what = {"ddp": "all-reduce of every gradient, in buckets",
                "zero1": "all-reduce of gradients, then all-gather of the updated parameter shards",
                "zero2": "reduce-scatter of gradients, then all-gather of the updated parameter shards",
                "fsdp": "all-gather of each unit's parameters (forward, and again in backward when resharded), "
                        "reduce-scatter of its gradients"}.get(kind, kind)
        lines.append(f"  dp: {what}, over {m.dp} ranks")
    if m.ep > 1:
        rep = m.dp // m.ep
        grads = (f"expert gradients all-reduced over the {rep} ranks holding the same experts" if rep > 1 else
                 "each rank holds its own experts, so their gradients need no all-reduce")
        lines.append(f"  ep: per MoE layer and microbatch, all-to-alls that send tokens to their experts' ranks "
                     f"and bring the results back (forward and backward), over {m.ep} ranks; {grads}")
    if m.tp > 1:
        lines.append(f"  tp: all-reduces inside each sharded column→row pair, forward and backward, over {m.tp} "
                     "ranks, per microbatch")
    if m.size == 1 or (m.pp == 1 and m.dp == 1 and m.tp == 1):
        lines.append("  none (one device)")
    return lines


