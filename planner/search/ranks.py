"""Where a configuration puts things: each pipeline rank's stages and layers, the parameters it
holds (tied copies included), and how long it waits at the ends of the pipeline.

Units: parameter elements (after the tensor-parallel split), seconds.
"""

from __future__ import annotations

import bisect
from functools import lru_cache

from planner.cluster import link_at
from planner.cost import LayerCost
from planner.cost_comm import all_gather_time, p2p_time
from planner.schedule_cost import stage_placement
from planner.search.config import Config, Context

__all__ = ["rank_stages", "rank_layers", "rank_params", "replicated_params", "kept_act", "drain_idle",
           "warmup_idle", "stage_send"]


def rank_stages(cfg: Config, rank: int) -> list[int]:
    """The stages (chunks) pipeline rank ``rank`` runs, in stage order."""
    return list(_stages_of(cfg.kind, cfg.pp, cfg.v)[rank])


@lru_cache(maxsize=1024)
def _stages_of(kind: str, pp: int, v: int) -> tuple[tuple[int, ...], ...]:
    where = stage_placement(kind, pp, v)
    return tuple(tuple(k for k, r in enumerate(where) if r == rank) for rank in range(pp))


def rank_layers(cfg: Config, rank: int) -> list[int]:
    """Indices of the layers pipeline rank ``rank`` runs, in execution order."""
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
    ties = ctx.ties(cfg.tp)
    if not ties:
        return 0.0
    held = set(layers)
    out: dict[int, float] = {}
    for user, owner, count in ties:
        if (user in held or owner in held) and _stage_of(cfg.cuts, user) != _stage_of(cfg.cuts, owner):
            out[owner] = count
    return sum(out.values())


def _stage_of(cuts: tuple[int, ...], layer: int) -> int:
    return bisect.bisect_right(cuts, layer) - 1


def kept_act(costs: list[LayerCost], i: int, recompute: frozenset[int], selective: frozenset[int]) -> float:
    """Bytes layer i keeps for backward per microbatch under its recompute kind."""
    if i in recompute:
        return costs[i].act_recompute
    if i in selective:
        return costs[i].act_selective
    return costs[i].act


def drain_idle(cfg: Config, stage_b: list[float], rank: int) -> float:
    """Seconds rank ``rank`` waits between its last backward and the end of the pipeline.

    Every schedule kind ends with the last microbatch's backward walking the stages down to stage
    0 on rank 0 (looped, interleaved and V placements alike put stage ``r`` on rank ``r``), so the
    rank whose lowest stage is ``k`` finishes when the backwards of stages ``k-1 … 0`` remain:
    ``Σ_{j<k} b_j`` (balanced 1F1B: ``r·b``). Its gradient reduction can run in that time.
    """
    first = min(rank_stages(cfg, rank))
    return sum(stage_b[:first])


def warmup_idle(cfg: Config, stage_f: list[float], rank: int) -> float:
    """Seconds rank ``rank`` waits at the start of a step for its first input, ``Σ_{j<k} f_j`` with
    ``k`` its lowest stage: a parameter all-gather of the previous step's update can run then."""
    first = min(rank_stages(cfg, rank))
    return sum(stage_f[:first])


def stage_send(ctx: Context, cfg: Config, nbytes: float) -> tuple[float, float]:
    """(seconds, bytes sent) of one pipeline send of ``nbytes`` (a rank's copy of a stage's output).

    Adjacent stages are ``tp·dp`` ranks apart, so they sit in different nodes once that fills a
    node; inside a node a send uses ``Cluster.link_rows("p2p")`` where calibration measured
    it (CPU ranks: a batch of the send and its paired receive), else the intra-node link. With
    ``CostOptions.p2p_scatter_gather`` and tp > 1 (and an unsharded output: sequence
    parallelism already shards it), each tp rank sends ``1/tp`` and the receivers all-gather the
    rest over NVLink (Narayanan et al. 2021 §4.1)."""
    c = ctx.cluster
    scatter = ctx.options.p2p_scatter_gather and cfg.tp > 1 and not cfg.sp
    sent = nbytes / cfg.tp if scatter else nbytes
    if cfg.tp * cfg.dp >= c.devices_per_node:
        bw, lat = c.inter_bandwidth * c.efficiency.network, c.inter_latency
    else:  # the pipeline send's own link where calibration measured one (CPU ranks), for its size
        bw, lat = link_at(c.link_rows("p2p"), sent)
    if scatter:
        gather = all_gather_time(nbytes, cfg.tp, bandwidth=c.intra_bandwidth * c.efficiency.network,
                                 latency=c.intra_latency)
        return p2p_time(sent, bandwidth=bw, latency=lat) + gather, sent
    return p2p_time(sent, bandwidth=bw, latency=lat), sent
