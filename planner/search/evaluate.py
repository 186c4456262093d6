"""Exact cost of one fully specified configuration: stages, schedule, data parallelism, recompute.

:func:`evaluate` is the single place a step time is assembled; the search's fast paths only
decide which configurations reach it, and :func:`planner.search.cost_plan` re-costs a
hand-edited plan through it too, so a plan's ``predicted`` numbers always come from here.

Step time (seconds) = pipeline time of the per-rank microbatch times (``planner.schedule_cost``)
+ the slowest rank's exposed work after the pipeline ends: its gradient reduction (less the time
it waited for the drain), its optimizer step, and ZeRO's parameter all-gather (less the time the
next step makes it wait for its first input) + on ranks time-sharing cores, the cores' idle time
(:func:`shared_core_idle_s`). Data-parallel terms come from
``planner.search.dp_cost``; memory from ``planner.search.memory``.
"""

from __future__ import annotations

from planner.cost import LayerCost
from planner.cost_host import recompute_host_s, runtime_host_s
from planner.cost_memory import DTYPE_BYTES, model_state_bytes, stepped_elements
from planner.schedule_cost import pipeline_time, stage_placement
from planner.search.config import Breakdown, Config, Context
from planner.search.dp_cost import optimizer_tensors, optimizer_time, rank_dp_comm
from planner.search.expert_cost import expert_comm, expert_matmul_extra, expert_params
from planner.search.memory import choose_recompute, rank_memory_parts, units_on
from planner.search.ranks import (drain_idle, rank_layers, rank_params, rank_stages, replicated_params, stage_send,
                                  warmup_idle)

__all__ = ["evaluate", "choose_recompute", "shared_core_pipeline_time", "shared_core_idle_s", "stage_cuts_even"]


def evaluate(ctx: Context, cfg: Config) -> Breakdown:
    """Predicted step time, memory and communication of ``cfg`` (its cuts and recompute set fixed)."""
    c = ctx.cluster
    micro = ctx.micro(cfg)
    costs = ctx.costs(cfg.tp, micro, cfg.param_dtype, cfg.sp)
    m = cfg.microbatches
    rec, sel = cfg.recompute, cfg.selective
    opts = ctx.options
    chunks = list(zip(cfg.cuts, cfg.cuts[1:]))
    stage_f = [sum(costs[i].fwd for i in range(a, b)) for a, b in chunks]
    stage_b = [sum(costs[i].bwd + _recompute_s(ctx, costs, i, rec, sel) for i in range(a, b)) for a, b in chunks]
    where = stage_placement(cfg.kind, cfg.pp, cfg.v)
    times, mems, comm, parts, tails = [], [], [], [], []
    host = 0.0
    worst = dict(compute=0.0, recompute=0.0, tp=0.0, p2p=0.0, ep=0.0, fsdp=0.0, host=0.0)
    tail_parts = (0.0, 0.0)
    for rank in range(cfg.pp):
        layers = rank_layers(cfg, rank)
        compute = sum(costs[i].fwd + costs[i].bwd - costs[i].tp_s for i in layers)
        t = sum(costs[i].fwd + costs[i].bwd for i in layers)
        t_rec = sum(_recompute_s(ctx, costs, i, rec, sel) for i in layers)
        tp_bytes = sum(costs[i].tp_bytes + (costs[i].tp_bytes_recompute if i in rec or i in sel else 0.0)
                       for i in layers)
        # pipeline sends: each chunk boundary sends activations forward and gradients backward
        p2p_s, p2p_bytes = 0.0, 0.0
        for k in rank_stages(cfg, rank):  # a boundary between two chunks of one rank (V's turn) sends nothing
            for j, out_layer in ((k + 1, cfg.cuts[k + 1] - 1), (k - 1, cfg.cuts[k] - 1)):
                if 0 <= j < cfg.pp * cfg.v and where[j] != rank:
                    s, b = stage_send(ctx, cfg, costs[out_layer].output)
                    p2p_s, p2p_bytes = p2p_s + s, p2p_bytes + b
        if opts.overlap_p2p:
            p2p_s = 0.0
        params = rank_params(ctx, costs, layers, cfg.tp)
        experts = expert_params(cfg, costs, layers)
        own = experts / cfg.ep  # this rank's experts: averaged over the dp/ep ranks holding them
        whole = replicated_params(ctx, cfg, costs, layers)
        a2a_s, a2a_bytes = expert_comm(ctx, cfg, costs, layers)
        moe_s = expert_matmul_extra(ctx, cfg, costs, layers)
        busy = t + t_rec + a2a_s + moe_s
        fwd = sum(costs[i].fwd for i in layers)
        units = units_on(ctx, cfg, costs, layers) if cfg.dp_kind == "fsdp" else []
        dp = rank_dp_comm(ctx, cfg, params=params - experts - whole, whole=whole, own=own, units=units,
                          busy=busy, fwd=fwd, bwd=busy - fwd)
        state = model_state_bytes(params - experts, dp_kind=cfg.dp_kind, dp=cfg.dp, param_dtype=cfg.param_dtype,
                                  optimizer=opts.optimizer) \
            + model_state_bytes(own, dp_kind="ddp", dp=cfg.dp, param_dtype=cfg.param_dtype, optimizer=opts.optimizer)
        n_opt = optimizer_tensors(cfg, tensors=sum(ctx.facts[i].param_tensors for i in layers), units=len(units),
                                  sharded_bytes=(params - experts - whole) * DTYPE_BYTES[cfg.reduce_dtype],
                                  whole=whole > 0)
        stepped = stepped_elements(params - experts, dp_kind=cfg.dp_kind, dp=cfg.dp) + own
        opt_s = optimizer_time(ctx, cfg, stepped, n_opt)
        # the runtime's own host work (CPU ranks): per step, per microbatch of each chunk, per dp tensor
        host_step, host_micro = runtime_host_s(c, chunks=len(rank_stages(cfg, rank)), dp=cfg.dp,
                                               tensors=sum(ctx.facts[i].param_tensors for i in layers))
        host = max(host, state) if cfg.offload else host
        sync = max(0.0, dp.sync_s - drain_idle(cfg, stage_b, rank))
        gather = max(0.0, dp.gather_s - warmup_idle(cfg, stage_f, rank))
        tails.append(sync + opt_s + gather + host_step)
        rank_t = busy + p2p_s + dp.per_microbatch_s + host_micro
        times.append(rank_t)
        parts.append(rank_memory_parts(ctx, cfg, costs, rank, rec, layers))
        mems.append(sum(parts[-1].values()))
        comm.append(m * (tp_bytes + p2p_bytes + a2a_bytes) + dp.bytes)
        if tails[-1] >= max(tails):
            tail_parts = (sync + gather, opt_s)
        if rank_t >= max(times):
            worst.update(compute=(compute + moe_s) * m, recompute=t_rec * m, tp=(t - compute) * m, ep=a2a_s * m,
                         p2p=p2p_s * m, fsdp=dp.per_microbatch_s * m, host=host_micro * m + host_step)
    pipe = shared_core_pipeline_time(cfg.kind, times, m, v=cfg.v, share=c.core_share)
    idle = shared_core_idle_s(m * sum(times) / len(times) + sum(tails) / len(tails), pipe + max(tails),
                              share=c.core_share, idle=c.core_idle)
    step = pipe + max(tails) + idle
    placed = stage_placement(cfg.kind, cfg.pp, cfg.v)
    sends = [costs[b - 1].output for k, (_, b) in enumerate(chunks[:-1]) if placed[k] != placed[k + 1]]
    stage_comm = 0.0 if opts.overlap_p2p or not sends else stage_send(ctx, cfg, max(sends))[0]
    bubble = max(0.0, (pipe - m * max(times)) / pipe) if pipe > 0 else 0.0
    recomputed = sum(ctx.facts[i].flops_fwd for i in rec) * ctx.global_batch
    return Breakdown(step_time_s=step, pipeline_s=pipe, bubble=bubble, rank_times_s=times,
                     compute_s=worst["compute"], recompute_s=worst["recompute"], tp_comm_s=worst["tp"],
                     ep_comm_s=worst["ep"], p2p_s=worst["p2p"], dp_comm_s=tail_parts[0] + worst["fsdp"],
                     optimizer_s=tail_parts[1], host_s=worst["host"], idle_s=idle, memory_bytes=mems, memory_parts=parts, stage_f_s=stage_f,
                     stage_b_s=stage_b, stage_comm_s=stage_comm, memory_cap=ctx.cap, host_memory_bytes=host,
                     host_memory_cap=ctx.host_cap, comm_bytes=max(comm), model_flops=ctx.model_flops,
                     hardware_flops=ctx.model_flops + recomputed, devices=cfg.pp * cfg.dp * cfg.tp,
                     cluster_devices=c.devices, peak_flops=c.compute_flops(cfg.param_dtype), config=cfg)


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


def shared_core_idle_s(work: float, step: float, *, share: float, idle: float) -> float:
    """Seconds the cores of ranks time-sharing them (``share`` ranks per core) add to a ``step``
    of the node's CPU work ``work`` (all ranks' busy seconds at the shared rate, over the ranks)
    by sitting idle while ranks wait on each other: the step takes at least ``work · (1 + idle)``
    (``Cluster.core_idle``, measured on real steps), and nothing is added where the dependency
    chain already leaves the cores that idle, or where every rank has a core of its own.
    Example: 0.5 s of CPU work per rank, idle 0.1, a CPU-bound step of 0.5 s: 0.05 s."""
    if share <= 1.0 or idle <= 0.0:
        return 0.0
    return max(0.0, work * (1.0 + idle) - step)


def _recompute_s(ctx: Context, costs: list[LayerCost], i: int, rec: frozenset[int], sel: frozenset[int]) -> float:
    """Seconds layer i spends recomputing per microbatch: its whole forward and checkpointing's host
    cost per op (full), or its cheap ops (selective)."""
    if i in rec:
        return costs[i].fwd + recompute_host_s(ctx.cluster, ctx.facts[i].ops)
    if i in sel:
        return costs[i].rec_selective
    return 0.0


def stage_cuts_even(n_layers: int, stages: int) -> tuple[int, ...]:
    """Boundaries that split n_layers into ``stages`` runs whose sizes differ by at most one."""
    return tuple(round(k * n_layers / stages) for k in range(stages + 1))
