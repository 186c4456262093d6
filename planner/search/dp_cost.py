"""Data-parallel communication and its overlap, for every ``data_parallel.kind``: the one place
where DDP, ZeRO-1/2 and FSDP traffic is turned into exposed seconds, for the exact cost
(:func:`rank_dp_comm`, used by ``evaluate``) and for the search's lower bound and stage cuts
(:func:`dp_bound_terms`, :func:`fsdp_microbatch_comm`).

Collectives run on the dp group as the cluster lays it out (``cost_comm.comm_group``: stride tp,
hierarchical inside/between nodes). What each kind sends, per rank (``P`` its parameter elements
that the kind shards, ``p``/``r`` bytes of the parameter and reduce dtypes):

========  =====================================================================================
ddp       gradients accumulate over the microbatches; one all-reduce of ``P·r`` per step in
          buckets, started during the rank's last microbatch backward (PyTorch DDP's no_sync
          then bucketed overlap; Megatron-LM's overlap_grad_reduce)
zero1     the same, as a reduce-scatter (each rank keeps its shard of the sum); after the step an
          all-gather of the updated ``P·p`` parameters, overlapping the next step's first forward
zero2     gradients are sharded, so each microbatch's backward reduce-scatters its buckets while
          it runs (DeepSpeed stage 2); the all-gather after the step as zero1. A runtime that
          accumulates full gradients instead (``CostOptions.accumulate_unsharded``) reduces once
fsdp      per microbatch: all-gather each unit (twice when resharded after forward) and
          reduce-scatter its gradient, prefetched under compute; the first unit's gather is
          exposed. With ``accumulate_unsharded`` the reduce-scatter runs once per step
========  =====================================================================================

Exposure: a reduction overlapped with a backward of ``b`` seconds leaves ``max(last bucket,
total - b)``; the gradient reduction of a pipeline rank also overlaps the time it waits for the
drain (``ranks.drain_idle``), and the parameter all-gather the time it waits for its first input
(``ranks.warmup_idle``); ``evaluate`` subtracts those. Tied weights kept whole and a rank's own
MoE experts add all-reduces to the same gradient stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from planner.cost_comm import (Group, comm_group, group_all_gather_time, group_all_gather_volume,
                               group_all_reduce_time, group_all_reduce_volume, group_reduce_scatter_time)
from planner.cost_memory import DTYPE_BYTES, optimizer_step_bytes
from planner.search.config import Config, Context

__all__ = ["DPComm", "rank_dp_comm", "dp_group", "fsdp_microbatch_comm", "dp_bound_terms", "dp_bound_affine",
           "optimizer_time", "optimizer_tensors"]

Collective = Callable[[Group, float], float]


@dataclass(kw_only=True)
class DPComm:
    """One pipeline rank's data-parallel traffic. Seconds, bytes."""

    per_microbatch_s: float = 0.0
    """Exposed seconds added to each microbatch of the rank (FSDP gathers, ZeRO-2 reduce-scatters)."""
    sync_s: float = 0.0
    """Gradient reduction still running after the rank's last backward (before the drain hides some)."""
    gather_s: float = 0.0
    """ZeRO-1/2 parameter all-gather still running when the rank's first forward could start
    (before the warm-up wait hides some)."""
    bytes: float = 0.0
    """Bytes the rank sends per step."""


def dp_group(ctx: Context, cfg: Config) -> Group:
    """The data-parallel group: dp ranks spaced tp apart."""
    return comm_group(ctx.cluster, cfg.dp, stride=cfg.tp)


def _bucketed(fn: Collective, g: Group, nbytes: float, bucket: float) -> tuple[float, float]:
    """(total seconds, seconds of the last bucket) of ``fn`` over ``nbytes`` in buckets of ``bucket``:
    one collective (and its latency) per bucket."""
    if nbytes <= 0 or g.size <= 1:
        return 0.0, 0.0
    n = max(1, math.ceil(nbytes / bucket))
    one = fn(g, nbytes / n)
    return n * one, one


def _overlapped(total: float, last: float, window: float, on: bool) -> float:
    """Exposed seconds of a bucketed stream of ``total`` seconds started alongside ``window`` seconds of compute."""
    return max(last, total - window) if on else total


def rank_dp_comm(ctx: Context, cfg: Config, *, params: float, whole: float, own: float, units: list[float],
                 busy: float, fwd: float, bwd: float) -> DPComm:
    """Data-parallel traffic of one pipeline rank.

    Args:
        params: parameter elements the kind shards and reduces (tp split; tied weights kept whole
            and the rank's experts excluded).
        whole: elements of tied weights kept whole on dp (all-reduced like DDP).
        own: elements of the rank's own MoE experts (all-reduced over the dp/ep ranks holding them).
        units: FSDP unit sizes on the rank (elements), root last.
        busy, fwd, bwd: seconds of one microbatch on the rank: all of it, its forward, its backward.
    """
    o, c = ctx.options, ctx.cluster
    m = cfg.microbatches
    pb, rb = DTYPE_BYTES[cfg.param_dtype], DTYPE_BYTES[cfg.reduce_dtype]
    g = dp_group(ctx, cfg)
    bucket = cfg.bucket_mb * 2**20
    out = DPComm()
    # tied weights kept whole and this rank's experts: more gradient all-reduces after the last backward
    extra = group_all_reduce_time(g, whole * rb) if cfg.dp > 1 else 0.0
    out.bytes += group_all_reduce_volume(g, whole * rb) if cfg.dp > 1 else 0.0
    if own and cfg.dp // cfg.ep > 1:
        eg = comm_group(c, cfg.dp // cfg.ep, stride=cfg.tp * cfg.ep)
        extra += group_all_reduce_time(eg, own * rb)
        out.bytes += group_all_reduce_volume(eg, own * rb)
    accumulate = o.accumulate_unsharded or m == 1
    if cfg.dp_kind == "fsdp" and (cfg.dp > 1 or cfg.offload):
        ag = sum(group_all_gather_time(g, u * pb) for u in units)
        rs = sum(group_reduce_scatter_time(g, u * rb) for u in units)
        gathers = 2 if cfg.reshard else 1
        per_mb = gathers * ag + (0.0 if o.accumulate_unsharded else rs)
        if cfg.offload:  # fp32 shards come up over PCIe before each gather, gradient shards go down
            per_mb += (gathers * 4 + rb) * params / max(1, cfg.dp) / c.host_bandwidth
        if o.overlap_fsdp and cfg.prefetch:
            first = group_all_gather_time(g, units[0] * pb) if units else 0.0
            out.per_microbatch_s = max(0.0, per_mb - busy) + first
        else:
            out.per_microbatch_s = per_mb
        if o.accumulate_unsharded:
            last = group_reduce_scatter_time(g, units[-1] * rb) if units else 0.0
            out.sync_s = _overlapped(rs + extra, last, bwd, o.overlap_dp)
        else:
            out.sync_s = _overlapped(extra, 0.0, bwd, o.overlap_dp)
        vol_ag = group_all_gather_volume(g, params * pb)
        vol_rs = group_all_gather_volume(g, params * rb)
        out.bytes += m * gathers * vol_ag + (1 if o.accumulate_unsharded else m) * vol_rs
        return out
    if cfg.dp <= 1:
        return out
    if cfg.dp_kind == "ddp":
        total, last = _bucketed(group_all_reduce_time, g, params * rb, bucket)
        out.sync_s = _overlapped(total + extra, last, bwd, o.overlap_dp)
        out.bytes += group_all_reduce_volume(g, params * rb)
        return out
    # zero1 / zero2: reduce-scatter the gradients, all-gather the updated parameters after the step
    rs_total, rs_last = _bucketed(group_reduce_scatter_time, g, params * rb, bucket)
    if cfg.dp_kind == "zero2" and not accumulate:
        out.per_microbatch_s = _overlapped(rs_total, rs_last, bwd, o.overlap_dp)
        out.sync_s = _overlapped(extra, 0.0, bwd, o.overlap_dp)
        out.bytes += m * group_all_gather_volume(g, params * rb)
    else:
        out.sync_s = _overlapped(rs_total + extra, rs_last, bwd, o.overlap_dp)
        out.bytes += group_all_gather_volume(g, params * rb)
    ag_total, ag_first = _bucketed(group_all_gather_time, g, params * pb, bucket)
    out.gather_s = _overlapped(ag_total, ag_first, fwd, o.overlap_dp)
    out.bytes += group_all_gather_volume(g, params * pb)
    return out


def fsdp_microbatch_comm(ctx: Context, cfg: Config, params: float) -> float:
    """Seconds of one microbatch's FSDP traffic for ``params`` elements sent as one unit (what
    the stage cutter and the lower bound use: per-unit latencies only add to it)."""
    if cfg.dp_kind != "fsdp" or not (cfg.dp > 1 or cfg.offload):
        return 0.0
    o = ctx.options
    g = dp_group(ctx, cfg)
    pb, rb = DTYPE_BYTES[cfg.param_dtype], DTYPE_BYTES[cfg.reduce_dtype]
    gathers = 2 if cfg.reshard else 1
    comm = gathers * group_all_gather_time(g, params * pb)
    if not o.accumulate_unsharded:
        comm += group_reduce_scatter_time(g, params * rb)
    if cfg.offload:
        comm += (gathers * 4 + rb) * params / max(1, cfg.dp) / ctx.cluster.host_bandwidth
    return comm


def dp_bound_terms(ctx: Context, cfg: Config, params: float) -> tuple[float, bool]:
    """(seconds of per-microbatch data-parallel traffic of a rank holding ``params`` elements,
    whether it overlaps compute) for the lower bound: FSDP's gathers and reduce-scatters, ZeRO-2's
    reduce-scatter, each as one collective (bucket and unit latencies only add to it)."""
    o = ctx.options
    if cfg.dp_kind == "fsdp" and (cfg.dp > 1 or cfg.offload):
        return fsdp_microbatch_comm(ctx, cfg, params), o.overlap_fsdp and cfg.prefetch
    if cfg.dp_kind == "zero2" and cfg.dp > 1 and cfg.microbatches > 1 and not o.accumulate_unsharded:
        rs = group_reduce_scatter_time(dp_group(ctx, cfg), params * DTYPE_BYTES[cfg.reduce_dtype])
        return rs, o.overlap_dp
    return 0.0, True


def dp_bound_affine(ctx: Context, cfg: Config) -> tuple[float, float, bool]:
    """:func:`dp_bound_terms` as ``(c0, c1, overlapped)`` with ``seconds = c0 + c1·params`` for
    ``params > 0`` (every collective here is a latency plus bytes over a bandwidth), so that the
    stage cutter evaluates it in O(1) per segment."""
    one, _ = dp_bound_terms(ctx, cfg, 1e9)
    two, overlapped = dp_bound_terms(ctx, cfg, 2e9)
    slope = (two - one) / 1e9
    return one - slope * 1e9, slope, overlapped


def optimizer_time(ctx: Context, cfg: Config, stepped: float, tensors: float = 0.0) -> float:
    """Seconds of the optimizer step over ``stepped`` parameter elements (``cost_memory.stepped_elements``)
    in ``tensors`` tensors: its memory traffic (``cost_memory.optimizer_step_bytes``, memory-bound),
    on the host when offloaded, and ``Cluster.optimizer_tensor_s`` of host time per tensor (its
    per-tensor ops). Example: 1e6 elements of fp32 Adam (72 MB) at 1 GB/s in 100 tensors at 50 us:
    72 ms + 5 ms = 77 ms."""
    c = ctx.cluster
    bw = c.host_memory_bandwidth if cfg.offload else c.hbm_bandwidth
    traffic = stepped * optimizer_step_bytes(ctx.options.optimizer, cfg.param_dtype)
    return traffic / (bw * c.efficiency.memory) + tensors * c.optimizer_tensor_s


def optimizer_tensors(cfg: Config, *, tensors: int, sharded_bytes: float, whole: bool, units: int) -> int:
    """Tensors the optimizer of one rank updates (``fairscale.runtime.optim``): DDP its ``tensors``
    parameter tensors; ZeRO one flat shard per gradient bucket of ``sharded_bytes``; FSDP one flat
    shard per unit; plus one for tied weights kept ``whole`` under a sharded kind."""
    if cfg.dp_kind in ("zero1", "zero2"):
        return max(1, math.ceil(sharded_bytes / (cfg.bucket_mb * 2**20))) + int(whole)
    if cfg.dp_kind == "fsdp":
        return max(1, units) + int(whole)
    return tensors
