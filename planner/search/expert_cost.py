"""What expert parallelism (``mesh.ep``) adds to a configuration's cost: the MoE expert weights a
rank splits, and the dispatch/combine all-to-alls of one microbatch."""

from __future__ import annotations

from planner.cost import LayerCost
from planner.cost_comm import all_to_all_volume, comm_group, group_all_to_all_time
from planner.search.config import Config, Context

__all__ = ["expert_params", "expert_comm"]


def expert_params(cfg: Config, costs: list[LayerCost], layers: list[int]) -> float:
    """MoE expert parameter elements of the rank's layers that expert parallelism splits (all of
    them, before the split; 0 when ep = 1)."""
    return sum(costs[i].experts for i in layers) if cfg.ep > 1 else 0.0


def expert_comm(ctx: Context, cfg: Config, costs: list[LayerCost], layers: list[int]) -> tuple[float, float]:
    """(seconds, bytes sent) of one microbatch's expert-parallel all-to-alls on a rank: dispatch
    and combine forward, both again backward, and once more forward for recomputed layers. Each
    rank keeps the 1/ep of its rows bound for its own experts (uniform routing)."""
    if cfg.ep <= 1:
        return 0.0, 0.0
    g = comm_group(ctx.cluster, cfg.ep, stride=cfg.tp)  # ep consecutive dp ranks
    seconds = volume = 0.0
    for i in layers:
        rows = costs[i].expert_rows
        if rows <= 0:
            continue
        times = 3 if i in cfg.recompute or i in cfg.selective else 2
        # dispatch and combine: two all-to-alls (``rows`` holds both payloads)
        seconds += times * 2 * group_all_to_all_time(g, rows / 2)
        volume += times * all_to_all_volume(rows, cfg.ep)
    return seconds, volume
