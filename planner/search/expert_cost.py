"""What mixture-of-experts layers add to a configuration's cost: the expert weights a rank holds
under expert parallelism (``mesh.ep``), the dispatch/combine all-to-alls, the busiest rank's extra
tokens (``CostOptions.moe_imbalance``), and the expert matmuls' weight reads.

Expert matmuls are grouped GEMMs with few tokens per expert (``tokens·top_k/E`` per rank without
expert parallelism), so they can be bound by reading the weights rather than by FLOPs: per
microbatch a rank reads each of its experts' weights once forward and twice backward (the input
gradient reads them, the weight gradient writes their size). Their time is the roofline
``max(FLOPs/(peak·e_mm), weight bytes/(HBM·e_mem))`` (Williams et al. 2009). With ep ranks a rank
holds ``E/ep`` experts and receives the tokens of ep ranks for them: the same FLOPs (times the
imbalance), ``1/ep`` of the weights. This is why expert parallelism pays on fine-grained MoE
(many small experts: Qwen-MoE's 60) even when its all-to-alls are not hidden.
"""

from __future__ import annotations

from planner.cost import LayerCost
from planner.cost_comm import all_to_all_volume, comm_group, group_all_to_all_time
from planner.cost_memory import DTYPE_BYTES
from planner.search.config import Config, Context

__all__ = ["expert_params", "expert_comm", "expert_matmul_extra"]


def expert_params(cfg: Config, costs: list[LayerCost], layers: list[int]) -> float:
    """MoE expert parameter elements of the rank's layers that expert parallelism splits (all of
    them, before the split; 0 when ep = 1)."""
    return sum(costs[i].experts for i in layers) if cfg.ep > 1 else 0.0


def expert_comm(ctx: Context, cfg: Config, costs: list[LayerCost], layers: list[int]) -> tuple[float, float]:
    """(seconds, bytes sent) of one microbatch's expert-parallel all-to-alls on a rank: dispatch
    and combine forward, both again backward, and once more forward for recomputed layers. The
    busiest rank of the ep group sends and receives ``moe_imbalance`` times the mean."""
    if cfg.ep <= 1:
        return 0.0, 0.0
    g = comm_group(ctx.cluster, cfg.ep, stride=cfg.tp)  # ep consecutive dp ranks
    skew = ctx.options.moe_imbalance
    seconds = volume = 0.0
    for i in layers:
        rows = costs[i].expert_rows * skew
        if rows <= 0:
            continue
        times = 3 if i in cfg.recompute or i in cfg.selective else 2
        # dispatch and combine: two all-to-alls, each carrying half of ``rows``
        seconds += times * 2 * group_all_to_all_time(g, rows / 2)
        volume += times * all_to_all_volume(rows, cfg.ep)
    return seconds, volume


def expert_matmul_extra(ctx: Context, cfg: Config, costs: list[LayerCost], layers: list[int]) -> float:
    """Seconds one microbatch's expert matmuls on the rank take beyond their FLOP time (already in
    the layers' ``fwd``/``bwd``): the weight-read roofline, and under expert parallelism the
    busiest rank's ``moe_imbalance`` (see the module docstring). Recomputed layers read forward twice."""
    c = ctx.cluster
    bw = c.hbm_bandwidth * c.efficiency.memory
    skew = ctx.options.moe_imbalance if cfg.ep > 1 else 1.0
    pb = DTYPE_BYTES[cfg.param_dtype]
    extra = 0.0
    for i in layers:
        cost = costs[i]
        if not cost.experts or not (cost.expert_fwd_s or cost.expert_bwd_s):
            continue
        read = (cost.experts / cfg.ep if cfg.ep > 1 else cost.experts_held) * pb / bw
        fwd = max(cost.expert_fwd_s * skew, read) - cost.expert_fwd_s
        bwd = max(cost.expert_bwd_s * skew, 2 * read) - cost.expert_bwd_s
        extra += fwd * (2 if i in cfg.recompute else 1) + bwd
    return extra
