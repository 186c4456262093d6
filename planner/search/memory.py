"""Memory per pipeline rank, and the recompute choice that makes a rank fit.

Parts (bytes): model states after data-parallel sharding (``planner.cost_memory``), activations
saved by the microbatches in flight (``planner.schedule_cost.in_flight``), or, when higher, what is
held while a recompute rebuilds one layer in backward (:func:`rank_memory_parts`), and buffers:
FSDP's gathered units (``planner.search.units``) and full-size gradient accumulators of runtimes
that accumulate unsharded (``CostOptions.accumulate_unsharded``).

The search's fast paths (:func:`choose_recompute`, ``planner.search.partition``) bound the
activations by ``flight × kept + the largest recomputed layer's activations``, never below the
exact peak, so a plan they accept fits.
"""

from __future__ import annotations

from planner.cost import LayerCost
from planner.cost_memory import DTYPE_BYTES, model_state_parts, unshard_buffer_bytes
from planner.schedule_cost import in_flight
from planner.search.config import Config, Context
from planner.search.expert_cost import expert_params
from planner.search.ranks import kept_act, rank_layers, rank_params, replicated_params
from planner.search.units import rank_unit_parts, rank_units

__all__ = ["rank_memory", "rank_memory_parts", "units_on", "fsdp_buffer_terms", "choose_recompute"]


def rank_memory(ctx: Context, cfg: Config, costs: list[LayerCost], rank: int, recompute: frozenset[int],
                layers: list[int] | None = None, selective: frozenset[int] | None = None) -> float:
    """Peak bytes of one pipeline rank: model states + activations (in flight, or while a recompute
    rebuilds a layer) + buffers (the sum of :func:`rank_memory_parts`)."""
    return sum(rank_memory_parts(ctx, cfg, costs, rank, recompute, layers, selective).values())


def units_on(ctx: Context, cfg: Config, costs: list[LayerCost], layers: list[int]) -> list[float]:
    """FSDP unit sizes (elements, tp split) on a rank holding ``layers``; root last."""
    return rank_units(ctx.units(cfg.units), [f.params for f in ctx.facts], costs, layers)


def _fsdp(cfg: Config) -> bool:
    return cfg.dp_kind == "fsdp" and (cfg.dp > 1 or cfg.offload)


def rank_memory_parts(ctx: Context, cfg: Config, costs: list[LayerCost], rank: int, recompute: frozenset[int],
                      layers: list[int] | None = None,
                      selective: frozenset[int] | None = None) -> dict[str, float]:
    """Peak bytes of one pipeline rank by part: parameters, gradients, optimizer, activations, buffers.

    Activations: ``flight`` microbatches keep ``kept`` bytes each after their forward; when the
    oldest one's backward recomputes layer ``i``, the rank holds ``(flight - 1) × kept``, what the
    layers before ``i`` keep for that microbatch, and layer ``i``'s full activations plus its kept
    input (less the part of that input its activations already hold); the peak is the larger.
    Example, one microbatch, blocks keeping 1 MiB inputs, each rebuilding 10 MiB (its input
    included), a head keeping 3 MiB after them: the forward ends at 4·1 + 3 = 7 MiB; the last
    block's recompute comes after the head's backward: 3·1 + 10 = 13 MiB."""
    layers = rank_layers(cfg, rank) if layers is None else layers
    selective = cfg.selective if selective is None else selective
    o = ctx.options
    params = rank_params(ctx, costs, layers, cfg.tp)
    whole = replicated_params(ctx, cfg, costs, layers)
    experts = expert_params(cfg, costs, layers)
    params -= experts * (1 - 1 / cfg.ep)  # the rank holds E/ep of them
    own = experts / cfg.ep
    sharded = params - whole - own
    as_run = o.runtime_mixed_precision
    parts = model_state_parts(sharded, dp_kind=cfg.dp_kind, dp=cfg.dp, param_dtype=cfg.param_dtype,
                              optimizer=o.optimizer, as_run=as_run)
    if whole or own:  # kept whole on the dp axis and all-reduced: tied copies, this rank's experts
        rep = model_state_parts(whole + own, dp_kind="ddp", dp=cfg.dp, param_dtype=cfg.param_dtype,
                                optimizer=o.optimizer, as_run=as_run)
        parts = {k: parts[k] + rep[k] for k in parts}
    if cfg.offload:
        parts = {k: 0.0 for k in parts}
    elif o.zero_shard_copy and cfg.dp_kind in ("zero1", "zero2") and DTYPE_BYTES[cfg.param_dtype] == 4:
        parts["parameters"] += sharded * 4 / cfg.dp
    flight = in_flight(cfg.kind, cfg.pp, cfg.microbatches, rank, v=cfg.v)
    each = {i: kept_act(costs, i, recompute, selective) for i in layers}
    kept = sum(each.values())
    # the backward of a recomputed layer rebuilds its full activations for one microbatch: by then
    # the layers after it have freed theirs for that microbatch, the ones before it keep theirs
    # (and the other microbatches in flight all of theirs); its kept input it saves once
    peak, before = flight * kept, 0.0
    for i in sorted(layers):
        if i in recompute or i in selective:
            rebuilt = costs[i].act + costs[i].act_recompute - costs[i].input_saved
            peak = max(peak, (flight - 1) * kept + before + rebuilt)
        before += each[i]
    buffers = 0.0
    if _fsdp(cfg):
        named, root = rank_unit_parts(ctx.units(cfg.units), [f.params for f in ctx.facts], costs, layers)
        buffers = unshard_buffer_bytes(named, param_dtype=cfg.param_dtype, reshard_after_forward=cfg.reshard,
                                       prefetch=cfg.prefetch, grad_dtype=cfg.reduce_dtype, root=root,
                                       reduce_in_flight=cfg.dp > 1)
    if o.accumulate_unsharded and cfg.microbatches > 1 and cfg.dp > 1 and (_fsdp(cfg) or cfg.dp_kind == "zero2"):
        buffers += sharded * DTYPE_BYTES[cfg.reduce_dtype]  # the full gradient accumulator between microbatches
    if as_run and DTYPE_BYTES[cfg.param_dtype] < 4 and not cfg.offload:  # ddp's casts, one set shared by the step
        cast = params if cfg.dp_kind == "ddp" else whole + own
        peak += cast_copy_elements(ctx, costs, layers, cast / params if params else 0.0) * DTYPE_BYTES[cfg.param_dtype]
    return {**parts, "activations": peak, "buffers": buffers}


def cast_copy_elements(ctx: Context, costs: list[LayerCost], layers: list[int], share: float) -> float:
    """Elements of the 16-bit copies a rank's step keeps when ``share`` of its parameters are kept in
    fp32 and cast for compute (DDP's, ``planner.cost_memory.runtime_mixed_parts``; one set shared
    by the step's microbatches, ``passes.ops.dp_ops``): of each layer's
    parameters on the rank (after the tp split), the part its ops save for backward
    (``LayerFacts.saved_params``). Example: a Llama block saves every weight; an embedding none."""
    held = 0.0
    for i in layers:
        f = ctx.facts[i]  # a tied weight is saved where it is read (an LM head), owned where first used
        held += f.saved_params * (min(1.0, costs[i].params / f.params) if f.params else 1.0)
    return held * share


def fsdp_buffer_terms(ctx: Context, cfg: Config, costs: list[LayerCost]) -> tuple[float, float, float, float]:
    """The buffers for the search's fast paths, as (bytes per parameter element the rank holds,
    fixed bytes of a rank holding every unit, elements ``U`` of the largest unit, bytes per element
    of ``U`` that the rank holding it holds at least, beyond the per-element term).

    A runtime that accumulates unsharded gradients holds a full gradient per element. FSDP without
    reshard holds every gathered parameter at the end of forward (per element). The fixed bytes
    are what the partition plans stages with, never below :func:`unshard_buffer_bytes`: the two
    largest units gathered (resharded) and one unit's gradient. The last term is for the bounds,
    never above it: the largest unit is gathered once and its gradient made once, so its rank
    holds at least ``U·max(p, g)`` (the neighbours beside it at those moments depend on the order)."""
    per = 0.0
    if ctx.options.accumulate_unsharded and cfg.microbatches > 1 and cfg.dp > 1 \
            and (_fsdp(cfg) or cfg.dp_kind == "zero2"):
        per += DTYPE_BYTES[cfg.reduce_dtype]
    if not _fsdp(cfg):
        return per, 0.0, 0.0, 0.0
    b, g = DTYPE_BYTES[cfg.param_dtype], DTYPE_BYTES[cfg.reduce_dtype]
    units = sorted(units_on(ctx, cfg, costs, list(range(len(costs)))), reverse=True) \
        or [max(c.params for c in costs)]
    if not cfg.reshard:
        return per + b, units[0] * g, units[0], max(0.0, g - b)
    second = units[1] if cfg.prefetch and len(units) > 1 else 0.0
    return per, (units[0] + second) * b + units[0] * g, units[0], max(b, g)


def choose_recompute(ctx: Context, cfg: Config) -> frozenset[int]:
    """Per rank, the cheapest layers to recompute fully so the rank fits (greedy knapsack by
    recompute seconds per byte freed, ties to the earlier layer). Ranks that fit recompute nothing;
    ranks that cannot fit recompute everything that helps (evaluate then reports the shortfall)."""
    costs = ctx.costs(cfg.tp, ctx.micro(cfg), cfg.param_dtype, cfg.sp)
    chosen: set[int] = set()
    for rank in range(cfg.pp):
        layers = rank_layers(cfg, rank)
        mem = rank_memory(ctx, cfg, costs, rank, frozenset(), layers)
        if mem <= ctx.cap:
            continue
        flight = in_flight(cfg.kind, cfg.pp, cfg.microbatches, rank, v=cfg.v)
        order = sorted((i for i in layers if costs[i].act > costs[i].act_recompute),
                       key=lambda i: (costs[i].fwd / (costs[i].act - costs[i].act_recompute), i))
        transient = 0.0
        for i in order:
            # freeing this layer's activations in flight; its full activations come back once, transiently
            mem -= flight * (costs[i].act - costs[i].act_recompute)
            if costs[i].act > transient:
                mem += costs[i].act - transient
                transient = costs[i].act
            chosen.add(i)
            if mem <= ctx.cap:
                break
    return frozenset(chosen)
