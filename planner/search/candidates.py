"""The search space, enumerated: every configuration the constraints allow.

Each candidate fixes the mesh (pp × dp × tp, and ep for MoE models), microbatches, schedule
(with its chunks per rank), data-parallel kind, sequence parallelism and FSDP units;
``planner.search.core`` then bounds, cuts and costs them. tp divides the node, the devices, the
attention heads and every split weight dimension (``planner.search.tp.tp_allowed``).

Meshes use every device, except where the global batch does not split over the data-parallel
ranks that would take: with ``idle`` the mesh then takes the largest dp that divides the batch
and leaves the rest idle (a 125M model, batch 512, on 3072 GPUs: dp 512 on 512 of them, rather
than stretching over the rest with a pipeline of one microbatch). Pipelines get at least as many
microbatches as stages; fewer (``ScheduleKind.fallback_offer``) only with ``short_pipelines``,
which the search asks for when nothing else can be planned.
"""

from __future__ import annotations

from typing import Callable

from planner.batch_stats import find_batch_stat_ops, microbatch_problem, min_rows
from planner.buffer_writes import buffer_write_problem, find_buffer_writes
from planner.cluster import default_compute_dtype
from planner.graph import ModelGraph
from planner.plan import PlanError
from planner.schedule_kinds import KINDS
from planner.search.config import Config, Context
from planner.search.space import Fixed, divisors
from planner.search.tp import tp_allowed, tp_refusal
from planner.search.units import sub_block_units

__all__ = ["enumerate_configs", "units_of"]

def units_of(ctx: Context, text: str | None) -> str | None:
    """The FSDP unit selector to cost (None: no selector, the block default); raises PlanError
    when it selects no module holding parameters."""
    if not text:
        return None
    ctx.units(text)
    return text


def enumerate_configs(graph: ModelGraph, ctx: Context, fixed: Fixed, rules: Callable[[int], dict[str, str]],
                      cuts: tuple[int, ...] | None, *, idle: bool = False,
                      short_pipelines: bool = False) -> tuple[list[Config], list[str]]:
    """Every configuration the constraints allow, and notes on what they ruled out. ``idle``: a
    mesh may leave devices idle when the batch does not split over all of them; ``short_pipelines``:
    also pipelines with fewer microbatches than stages."""
    c = ctx.cluster
    N, L, B = c.devices, len(ctx.facts), ctx.global_batch
    notes: list[str] = []
    # largest degree first: a detector that checked its rules at T may reuse that check at T's divisors
    allowed_tp = sorted(t for t in range(min(c.devices_per_node, N), 0, -1)
                        if N % t == 0 and c.devices_per_node % t == 0 and tp_allowed(graph, rules(t), t))
    if fixed.tp is not None and fixed.tp not in allowed_tp:
        why = tp_refusal(graph, rules(fixed.tp), fixed.tp, devices=N, per_node=c.devices_per_node)
        raise PlanError([f"mesh.tp: tp={fixed.tp} is not possible here; allowed degrees are {allowed_tp} ({why})"],
                        source="constraints")
    dtype = fixed.param_dtype or default_compute_dtype(c)
    experts = [e.num_experts for e in graph.experts().values()]  # one walk of the graph
    units: list[str | None] = [units_of(ctx, fixed.units)] if fixed.units else [None]
    if fixed.units is None and (sub := sub_block_units(ctx.graph, graph.blocks)) is not None:
        units.append(sub)  # smaller units, smaller unshard buffers: what very large FSDP models need
    stats = find_batch_stat_ops(graph.gm)
    # BatchNorm is exact over dp ranks (synchronized) but not across microbatches: one microbatch
    # unless the constraints opt in to per-microbatch statistics
    one_microbatch = bool(stats) and fixed.batch_norm != "local"
    if one_microbatch and fixed.microbatches is not None and fixed.microbatches > 1:
        raise PlanError([microbatch_problem(stats, fixed.microbatches)], source="constraints")
    writes = find_buffer_writes(graph.gm)  # updated once per step in one process: the batch stays whole
    if (cut := buffer_write_problem(writes, dp=fixed.dp or 1, microbatches=fixed.microbatches or 1,
                                    where="constraints", shards_params=fixed.dp_kind == "fsdp")) is not None:
        raise PlanError([cut], source="constraints")
    one_microbatch = one_microbatch or bool(writes)
    rows = min_rows(stats)
    out: list[Config] = []
    for tp in ([fixed.tp] if fixed.tp else allowed_tp):
        if fixed.ep and fixed.ep > 1 and "expert" in rules(tp).values():
            notes.append(f"tp={tp}: its rules split the experts over tp, so they cannot also be split over "
                         f"ep={fixed.ep}")
            continue
        for pp in divisors(N // tp):
            dp = _data_parallel(N // (tp * pp), B, fixed.dp, idle)
            if (fixed.pp and pp != fixed.pp) or pp > L:
                continue
            if dp is None:
                notes.append(f"dp={fixed.dp or N // (tp * pp)} does not divide the global batch {B}")
                continue
            if writes and dp > 1 and (cut := buffer_write_problem(writes, dp=dp, microbatches=1)) is not None:
                notes.append(cut)
                continue
            per = B // dp
            ms = divisors(per) if fixed.microbatches is None else (
                [fixed.microbatches] if per % fixed.microbatches == 0 else [])
            if not ms:
                notes.append(f"microbatches={fixed.microbatches} does not divide the per-replica batch {per} (dp={dp})")
            if one_microbatch:
                ms = [m for m in ms if m == 1]
            for m in [m for m in ms if per // m < rows]:
                notes.append(f"dp={dp} × microbatches={m} leaves {per // m} sample per rank microbatch, too few for "
                             "the model's batch norm (one value per channel)")
            ms = [m for m in ms if per // m >= rows]
            for m in ms:
                schedules = _schedules(pp, m, L, fixed, cuts, short_pipelines)
                if not schedules and fixed.kind is not None:  # say why the asked kind offers nothing here
                    broken = [msg for _, msg in KINDS[fixed.kind].problems(pp, m, fixed.virtual_stages or 1)]
                    notes.append(f"pp={pp} dp={dp} tp={tp}, {m} microbatch(es): " + (
                        "; ".join(broken) or f"schedule kind {fixed.kind!r} offers no schedule for it"))
                for kind, v in schedules:
                    for dp_kind, reshard in _dp_kinds(dp, fixed):
                        if dp > 1 and buffer_write_problem(writes, dp=dp, microbatches=1,
                                                           shards_params=dp_kind == "fsdp") is not None:
                            continue  # fsdp would drop a parameter's write into its gathered copy
                        for sp in ([False, True] if tp > 1 else [False]):
                            if fixed.sequence_parallel is not None and sp != fixed.sequence_parallel:
                                continue
                            for ep in _expert_degrees(graph, experts, dp, fixed, rules(tp)):
                                for unit in (units if dp_kind == "fsdp" else [None]):
                                    out.append(Config(pp=pp, dp=dp, tp=tp, microbatches=m, kind=kind, v=v,
                                                      dp_kind=dp_kind, reshard=reshard, sp=sp, param_dtype=dtype,
                                                      reduce_dtype=fixed.reduce_dtype or "fp32",
                                                      prefetch=True if fixed.prefetch is None else fixed.prefetch,
                                                      bucket_mb=fixed.bucket_mb or 25.0, units=unit,
                                                      offload=bool(fixed.offload), ep=ep))
    if fixed.pp and fixed.pp > L:
        names = ", ".join(f.name for f in ctx.facts[:4]) + (", ..." if L > 4 else "")
        notes.append(f"pp={fixed.pp} is more than the {L} layer(s) a pipeline can cut this model into "
                     f"(module {names}): stages are cut between the children of a repeated block (a "
                     "ModuleList: model.layers.0, model.layers.1, ...), or, without one, between the modules "
                     f"the model's forward calls; use mesh.pp of at most {L}")
    return out, notes


def _data_parallel(most: int, batch: int, fixed: int | None, idle: bool) -> int | None:
    """The dp of a mesh with room for ``most`` data-parallel ranks: all of them when they divide the
    batch, else (``idle``) the largest divisor of the batch below it; the fixed dp if it fits."""
    if fixed is not None:
        ok = fixed <= most and batch % fixed == 0 and (fixed == most or idle)
        return fixed if ok else None
    if batch % most == 0:
        return most
    if not idle:
        return None
    return max(d for d in divisors(batch) if d <= most)


def _expert_degrees(graph: ModelGraph, counts: list[int], dp: int, fixed: Fixed, rules: dict[str, str]) -> list[int]:
    """Expert-parallel degrees to try: 1, and for MoE models (``counts``: each MoE layer's experts)
    every divisor of dp that divides every layer's expert count (not when the tp rules already
    split the experts)."""
    if fixed.ep is not None:  # enumerate_configs skips the tp degrees whose rules split experts when ep > 1
        if fixed.ep > 1 and not counts:
            raise PlanError([f"mesh.ep: {fixed.ep}, but {graph.model_class} has no mixture-of-experts layer; drop "
                             "mesh.ep"], source="constraints")
        return [fixed.ep] if dp % fixed.ep == 0 and all(c % fixed.ep == 0 for c in counts) else []
    if not counts or "expert" in rules.values():  # the tp rules split the experts: planner.validate_tp refuses ep too
        return [1]
    return [e for e in divisors(dp) if all(c % e == 0 for c in counts)]


def _schedules(pp: int, m: int, L: int, fixed: Fixed, cuts: tuple[int, ...] | None,
               short_pipelines: bool = False) -> list[tuple[str, int]]:
    """(kind, chunks per rank) pairs to try: what each kind offers (``ScheduleKind.offer``, and
    ``fallback_offer`` with ``short_pipelines``), kept to the constraints' kind, chunk count and
    stage count."""
    stages = len(cuts) - 1 if cuts else None
    opts = [(name, v) for name, kind in KINDS.items()
            for v in kind.offer(pp, m, L, asked=fixed.kind == name, chunks=fixed.virtual_stages)]
    if short_pipelines:
        opts += [(name, v) for name, kind in KINDS.items() for v in kind.fallback_offer(pp, m)
                 if (name, v) not in opts]
    if fixed.kind is not None:
        opts = [o for o in opts if o[0] == fixed.kind]
    if fixed.virtual_stages is not None:
        opts = [o for o in opts if o[1] == fixed.virtual_stages]
    if stages is not None:
        opts = [o for o in opts if pp * o[1] == stages]
    return opts


def _dp_kinds(dp: int, fixed: Fixed) -> list[tuple[str, bool]]:
    if fixed.offload:  # the cost model offloads FSDP shards only
        opts = [("fsdp", True), ("fsdp", False)]
    elif dp == 1:
        opts = [("ddp", True)] if fixed.dp_kind is None else [(fixed.dp_kind, True)]
    else:
        opts = [("ddp", True), ("zero1", True), ("zero2", True), ("fsdp", True), ("fsdp", False)]
        if fixed.dp_kind is not None:
            opts = [o for o in opts if o[0] == fixed.dp_kind]
    if fixed.reshard is not None:
        opts = [(k, fixed.reshard if k == "fsdp" else r) for k, r in opts]
        opts = list(dict.fromkeys(opts))
    return opts
