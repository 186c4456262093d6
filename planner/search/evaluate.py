"""Exact cost of one fully specified configuration: stages, schedule, data parallelism, recompute.

:func:`evaluate` is the single place a step time is assembled; the search's fast paths only
decide which configurations reach it, and :func:`planner.search.cost_plan` re-costs a
hand-edited plan through it too, so a plan's ``predicted`` numbers always come from here.

Step time (seconds) = pipeline time of the per-rank microbatch times (``planner.schedule_cost``)
+ the slowest rank's exposed gradient synchronization and optimizer step after the flush.
"""

from __future__ import annotations

import math

from planner.cost import LayerCost
from planner.cost_comm import (all_gather_time, all_gather_volume, all_reduce_time, all_reduce_volume, p2p_time,
                               reduce_scatter_time)
from planner.cost_memory import DTYPE_BYTES, model_state_bytes, model_state_parts, unshard_buffer_bytes
from planner.schedule_cost import in_flight, pipeline_time, stage_placement
from planner.search.config import Breakdown, Config, Context
from planner.search.expert_cost import expert_comm, expert_params

__all__ = ["evaluate", "choose_recompute", "shared_core_pipeline_time"]


def rank_stages(cfg: Config, rank: int) -> list[int]:
    """The stages (chunks) pipeline rank ``rank`` runs, in stage order."""
    return [k for k, r in enumerate(stage_placement(cfg.kind, cfg.pp, cfg.v)) if r == rank]


def rank_layers(cfg: Config, rank: int) -> list[int]:
    out: list[int] = []
    for k in rank_stages(cfg, rank):
        out.extend(range(cfg.cuts[k], cfg.cuts[k + 1]))
    return out


def rank_params(ctx: Context, costs: list[LayerCost], layers: list[int], tp: int) -> float:
    """Parameter elements a rank holds: its layers' own, plus copies of tied weights owned elsewhere."""
    held = set(layers)
    total = sum(costs[i].params for i in layers)
    copied: set[int] = set()
    facts = ctx.facts_for(tp)
    for i in layers:
        f = facts[i]
        for owner, count in f.tied:
            if owner not in held and owner not in copied:
                copied.add(owner)
                total += count / (tp if f.tp.sharded and tp > 1 else 1)
    return total


def replicated_params(ctx: Context, cfg: Config, costs: list[LayerCost], layers: list[int]) -> float:
    """Parameter elements of this rank that stay whole under a sharded data-parallel kind: tied
    weights whose uses sit on different stages (GPT's embedding and head). The runtime keeps them
    unsharded and all-reduces their gradients like DDP, so the pipeline can sum the copies'
    gradients (``passes.compile_rank(replicate=...)``). 0 for ddp or dp = 1."""
    if cfg.dp_kind == "ddp" or cfg.dp <= 1 or cfg.pp * cfg.v <= 1:
        return 0.0
    stage = {}
    for k, (a, b) in enumerate(zip(cfg.cuts, cfg.cuts[1:])):
        for i in range(a, b):
            stage[i] = k
    held = set(layers)
    out: dict[int, float] = {}
    for f in ctx.facts_for(cfg.tp):
        for owner, count in f.tied:
            if stage.get(f.index) != stage.get(owner) and (f.index in held or owner in held):
                out[owner] = count / (cfg.tp if f.tp.sharded and cfg.tp > 1 else 1)
    return sum(out.values())


def kept_act(costs: list[LayerCost], i: int, recompute: frozenset[int], selective: frozenset[int]) -> float:
    """Bytes layer i keeps for backward per microbatch under its recompute kind."""
    if i in recompute:
        return costs[i].act_recompute
    if i in selective:
        return costs[i].act_selective
    return costs[i].act


def rank_memory(ctx: Context, cfg: Config, costs: list[LayerCost], rank: int, recompute: frozenset[int],
                layers: list[int] | None = None, selective: frozenset[int] | None = None) -> float:
    """Peak bytes of one pipeline rank: model states + activations in flight + recompute transient
    + FSDP unshard buffers (the sum of :func:`rank_memory_parts`)."""
    return sum(rank_memory_parts(ctx, cfg, costs, rank, recompute, layers, selective).values())


def rank_memory_parts(ctx: Context, cfg: Config, costs: list[LayerCost], rank: int, recompute: frozenset[int],
                      layers: list[int] | None = None,
                      selective: frozenset[int] | None = None) -> dict[str, float]:
    """Peak bytes of one pipeline rank by part: parameters, gradients, optimizer, activations, buffers."""
    layers = rank_layers(cfg, rank) if layers is None else layers
    selective = cfg.selective if selective is None else selective
    params = rank_params(ctx, costs, layers, cfg.tp)
    whole = replicated_params(ctx, cfg, costs, layers)
    experts = expert_params(cfg, costs, layers)
    params -= experts * (1 - 1 / cfg.ep)  # the rank holds E/ep of them
    own = experts / cfg.ep
    parts = model_state_parts(params - whole - own, dp_kind=cfg.dp_kind, dp=cfg.dp, param_dtype=cfg.param_dtype,
                              optimizer=ctx.options.optimizer)
    if whole or own:  # kept whole on the dp axis and all-reduced: tied copies, this rank's experts
        rep = model_state_parts(whole + own, dp_kind="ddp", dp=cfg.dp, param_dtype=cfg.param_dtype,
                                optimizer=ctx.options.optimizer)
        parts = {k: parts[k] + rep[k] for k in parts}
    if cfg.offload:
        parts = {k: 0.0 for k in parts}
    elif ctx.options.zero_shard_copy and cfg.dp_kind in ("zero1", "zero2") and DTYPE_BYTES[cfg.param_dtype] == 4:
        parts["parameters"] += (params - whole - own) * 4 / cfg.dp
    flight = in_flight(cfg.kind, cfg.pp, cfg.microbatches, rank, v=cfg.v)
    kept = sum(kept_act(costs, i, recompute, selective) for i in layers)
    # the backward of a recomputed layer rebuilds its full activations for one microbatch
    transient = max((costs[i].act for i in layers if i in recompute or i in selective), default=0.0)
    buffers = 0.0
    if cfg.dp_kind == "fsdp" and (cfg.dp > 1 or cfg.offload):
        buffers = unshard_buffer_bytes(_unit_params(ctx, cfg, costs, layers), param_dtype=cfg.param_dtype,
                                       reshard_after_forward=cfg.reshard, prefetch=cfg.prefetch)
        if ctx.options.fsdp_accumulate_unsharded and cfg.microbatches > 1:
            buffers += params * DTYPE_BYTES[cfg.reduce_dtype]  # every unit's full gradient accumulator
    return {**parts, "activations": flight * kept + transient, "buffers": buffers}


def _unit_params(ctx: Context, cfg: Config, costs: list[LayerCost], layers: list[int]) -> list[float]:
    units = ctx.blocks if cfg.units is None else cfg.units
    own = [costs[i].params for i in layers if i in units]
    root = sum(costs[i].params for i in layers if i not in units)
    return own + ([root] if root > 0 else [])


def fsdp_buffer_terms(ctx: Context, cfg: Config, costs: list[LayerCost]) -> tuple[float, float]:
    """FSDP unshard buffers as (bytes per parameter element the rank holds, fixed bytes), for the
    search's fast paths: without reshard every gathered parameter stays (per element), with it the
    two largest units do (fixed); plus one unit of full gradients either way."""
    if cfg.dp_kind != "fsdp" or (cfg.dp <= 1 and not cfg.offload):
        return 0.0, 0.0
    b = DTYPE_BYTES[cfg.param_dtype]
    units = sorted((c.params for i, c in enumerate(costs) if i in (ctx.blocks if cfg.units is None else cfg.units)),
                   reverse=True) or [max(c.params for c in costs)]
    if not cfg.reshard:
        return float(b), units[0] * b
    return 0.0, (units[0] + (units[1] if cfg.prefetch and len(units) > 1 else 0.0) + units[0]) * b


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


def evaluate(ctx: Context, cfg: Config) -> Breakdown:
    """Predicted step time, memory and communication of ``cfg`` (its cuts and recompute set fixed)."""
    c = ctx.cluster
    net = c.efficiency.network
    micro = ctx.micro(cfg)
    costs = ctx.costs(cfg.tp, micro, cfg.param_dtype, cfg.sp)
    m = cfg.microbatches
    dp_bw, dp_lat = c.link(cfg.tp * cfg.dp)
    dp_bw *= net
    pp_bw, pp_lat = c.link(cfg.tp * cfg.dp * cfg.pp)
    pp_bw *= net
    pbytes, rbytes = DTYPE_BYTES[cfg.param_dtype], DTYPE_BYTES[cfg.reduce_dtype]
    rec, sel = cfg.recompute, cfg.selective
    opts = ctx.options
    times, mems, comm, parts = [], [], [], []
    host = 0.0
    worst = dict(compute=0.0, recompute=0.0, tp=0.0, p2p=0.0, dp=0.0, opt=0.0, tail=0.0)
    for rank in range(cfg.pp):
        layers = rank_layers(cfg, rank)
        compute = sum(_pure(ctx, costs, i, cfg) for i in layers)
        t = sum(costs[i].fwd + costs[i].bwd for i in layers)
        t_rec = sum(_recompute_s(costs, i, rec, sel) for i in layers)
        tp_s = t - compute
        tp_bytes = sum(costs[i].tp_bytes + (costs[i].tp_bytes_recompute if i in rec or i in sel else 0.0)
                       for i in layers)
        # pipeline sends: each chunk boundary sends activations forward and gradients backward
        p2p_s, p2p_bytes = 0.0, 0.0
        where = stage_placement(cfg.kind, cfg.pp, cfg.v)
        for k in rank_stages(cfg, rank):  # a boundary between two chunks of one rank (V's turn) sends nothing
            if k + 1 < cfg.pp * cfg.v and where[k + 1] != rank:
                nbytes = costs[cfg.cuts[k + 1] - 1].output
                p2p_bytes += nbytes
                p2p_s += p2p_time(nbytes, bandwidth=pp_bw, latency=pp_lat)
            if k > 0 and where[k - 1] != rank:
                nbytes = costs[cfg.cuts[k] - 1].output
                p2p_bytes += nbytes
                p2p_s += p2p_time(nbytes, bandwidth=pp_bw, latency=pp_lat)
        if opts.overlap_p2p:
            p2p_s = 0.0
        params = rank_params(ctx, costs, layers, cfg.tp)
        experts = expert_params(cfg, costs, layers)
        own = experts / cfg.ep  # this rank's experts: averaged over the dp/ep ranks holding them
        params -= experts  # what the dp kind shards and reduces
        a2a_s, a2a_bytes = expert_comm(ctx, cfg, costs, layers)
        busy = t + t_rec + a2a_s
        fsdp_s, dp_bytes, tail = 0.0, 0.0, 0.0
        if cfg.dp_kind == "fsdp" and (cfg.dp > 1 or cfg.offload):
            gathers = 2 if cfg.reshard else 1
            units = _unit_params(ctx, cfg, costs, layers)
            # one collective per unit: the bandwidth term of the total, the latency term per unit
            extra_lat = (len(units) - 1) * (cfg.dp - 1) * dp_lat if cfg.dp > 1 and units else 0.0
            ag = all_gather_time(params * pbytes, cfg.dp, bandwidth=dp_bw, latency=dp_lat) + extra_lat
            rs = reduce_scatter_time(params * rbytes, cfg.dp, bandwidth=dp_bw, latency=dp_lat) + extra_lat
            # reduce-scatter every microbatch, or once per step when gradients accumulate unsharded
            once = opts.fsdp_accumulate_unsharded
            per_mb = gathers * ag + (rs / m if once else rs)
            if cfg.offload:  # fp32 shards come up over PCIe before each gather, gradient shards go down
                per_mb += (gathers * params / cfg.dp * 4 + params / cfg.dp * rbytes) / c.host_bandwidth
            if opts.overlap_fsdp and cfg.prefetch:
                first = ag * (units[0] / params) if params > 0 and units else 0.0
                fsdp_s = max(0.0, per_mb - busy) + first
            else:
                fsdp_s = per_mb
            dp_bytes = m * gathers * all_gather_volume(params * pbytes, cfg.dp) \
                + (1 if once else m) * all_gather_volume(params * rbytes, cfg.dp)
        elif cfg.dp > 1:
            # gradients travel in buckets: one collective (and its latency) per bucket
            buckets = max(1, math.ceil(params * rbytes / (cfg.bucket_mb * 2**20)))
            extra_lat = (buckets - 1) * (cfg.dp - 1) * dp_lat
            if cfg.dp_kind == "ddp":
                sync = all_reduce_time(params * rbytes, cfg.dp, bandwidth=dp_bw, latency=dp_lat) + 2 * extra_lat
                after = 0.0
                dp_bytes = all_reduce_volume(params * rbytes, cfg.dp)
            else:  # zero1 / zero2: reduce-scatter grads, all-gather updated params after the step
                sync = reduce_scatter_time(params * rbytes, cfg.dp, bandwidth=dp_bw, latency=dp_lat) + extra_lat
                after = all_gather_time(params * pbytes, cfg.dp, bandwidth=dp_bw, latency=dp_lat)
                dp_bytes = all_gather_volume(params * rbytes, cfg.dp) + all_gather_volume(params * pbytes, cfg.dp)
            if opts.overlap_dp:
                bucket = min(params * rbytes, cfg.bucket_mb * 2**20)
                last = all_reduce_time(bucket, cfg.dp, bandwidth=dp_bw, latency=dp_lat)
                bwd_last = sum(costs[i].bwd for i in layers)
                sync = max(last, sync - bwd_last)
            tail = sync + after
        whole = replicated_params(ctx, cfg, costs, layers)
        if whole:  # tied weights kept whole: one more all-reduce of their gradients after the flush
            tail += all_reduce_time(whole * rbytes, cfg.dp, bandwidth=dp_bw, latency=dp_lat)
            dp_bytes += all_reduce_volume(whole * rbytes, cfg.dp)
        if own:
            tail += all_reduce_time(own * rbytes, cfg.dp // cfg.ep, bandwidth=dp_bw, latency=dp_lat)
            dp_bytes += all_reduce_volume(own * rbytes, cfg.dp // cfg.ep)
        state = model_state_bytes(params, dp_kind=cfg.dp_kind, dp=cfg.dp, param_dtype=cfg.param_dtype,
                                  optimizer=opts.optimizer) \
            + model_state_bytes(own, dp_kind="ddp", dp=cfg.dp, param_dtype=cfg.param_dtype, optimizer=opts.optimizer)
        # Adam reads and writes every state byte once (memory-bound), on the host when offloaded
        opt_bw = c.host_memory_bandwidth if cfg.offload else c.hbm_bandwidth
        opt_s = 2 * state / (opt_bw * c.efficiency.memory)
        host = max(host, state) if cfg.offload else host
        rank_t = busy + p2p_s + fsdp_s
        times.append(rank_t)
        parts.append(rank_memory_parts(ctx, cfg, costs, rank, rec, layers))
        mems.append(sum(parts[-1].values()))
        comm.append(m * (tp_bytes + p2p_bytes + a2a_bytes) + dp_bytes)
        if tail + opt_s >= worst["tail"]:
            worst["tail"], worst["dp"], worst["opt"] = tail + opt_s, tail, opt_s
        if rank_t >= max(times):
            worst.update(compute=compute * m, recompute=t_rec * m, tp=tp_s * m, ep=a2a_s * m, p2p=p2p_s * m,
                         fsdp=fsdp_s * m)
    pipe = shared_core_pipeline_time(cfg.kind, times, m, v=cfg.v, share=c.core_share)
    step = pipe + worst["tail"]
    chunks = list(zip(cfg.cuts, cfg.cuts[1:]))
    stage_f = [sum(costs[i].fwd for i in range(a, b)) for a, b in chunks]
    stage_b = [sum(costs[i].bwd + _recompute_s(costs, i, rec, sel) for i in range(a, b)) for a, b in chunks]
    placed = stage_placement(cfg.kind, cfg.pp, cfg.v)
    sends = [costs[b - 1].output for k, (_, b) in enumerate(chunks[:-1]) if placed[k] != placed[k + 1]]
    stage_comm = 0.0 if opts.overlap_p2p or not sends else p2p_time(max(sends), bandwidth=pp_bw, latency=pp_lat)
    bubble = max(0.0, (pipe - m * max(times)) / pipe) if pipe > 0 else 0.0
    return Breakdown(step_time_s=step, pipeline_s=pipe, bubble=bubble, rank_times_s=times,
                     compute_s=worst["compute"], recompute_s=worst["recompute"], tp_comm_s=worst["tp"],
                     ep_comm_s=worst.get("ep", 0.0),
                     p2p_s=worst["p2p"], dp_comm_s=worst["dp"] + worst.get("fsdp", 0.0), optimizer_s=worst["opt"],
                     memory_bytes=mems, memory_parts=parts, stage_f_s=stage_f, stage_b_s=stage_b,
                     stage_comm_s=stage_comm, memory_cap=ctx.cap, host_memory_bytes=host, host_memory_cap=ctx.host_cap,
                     comm_bytes=max(comm), model_flops=ctx.model_flops,
                     devices=cfg.pp * cfg.dp * cfg.tp, config=cfg)


def shared_core_pipeline_time(kind: str, times: list[float], m: int, *, v: int = 1, share: float = 1.0) -> float:
    """Pipeline seconds when ranks time-share cores (``share`` ranks per core, 1 = dedicated).

    ``times`` are per-rank microbatch times at the all-ranks-busy rate. A waiting rank's share
    goes to the busy ones (processor sharing), so two bounds hold and the larger is the estimate:
    the dependency chain with every rank at a full core, ``pipeline_time(times / share)``, and the
    CPU work of the node spread over its cores, ``m · mean(times)`` (all ranks' busy seconds at
    the shared rate, divided by the ranks: the bubble costs no CPU). With ``share`` = 1 this is
    :func:`planner.schedule_cost.pipeline_time`. Example: 8 balanced stages of 1 s, m = 8, 8 ranks
    on 2 cores (share 4): max(15 s / 4, 8 · 1 s) = 8 s instead of 15 s.
    """
    if share <= 1.0:
        return pipeline_time(kind, times, m, v=v)
    chain = pipeline_time(kind, [t / share for t in times], m, v=v)
    return max(chain, m * sum(times) / len(times))


def _recompute_s(costs: list[LayerCost], i: int, rec: frozenset[int], sel: frozenset[int]) -> float:
    """Seconds layer i spends recomputing per microbatch: its whole forward (full) or its cheap ops (selective)."""
    if i in rec:
        return costs[i].fwd
    if i in sel:
        return costs[i].rec_selective
    return 0.0


def _pure(ctx: Context, costs: list[LayerCost], i: int, cfg: Config) -> float:
    """Forward + backward seconds of layer i without its tensor-parallel collectives."""
    return costs[i].fwd + costs[i].bwd - costs[i].tp_s


def stage_cuts_even(n_layers: int, stages: int) -> tuple[int, ...]:
    """Boundaries that split n_layers into ``stages`` runs whose sizes differ by at most one."""
    return tuple(round(k * n_layers / stages) for k in range(stages + 1))

