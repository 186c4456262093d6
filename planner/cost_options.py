"""What the runtime overlaps and keeps, as the cost model must assume it: :class:`CostOptions`.

Usage::

    from planner.cost_options import CostOptions
    opts = CostOptions.for_runtime(cluster)       # this project's runtime on that cluster
    opts = CostOptions.megatron2021()             # the paper's runtime, for its Table 1

(``planner.cost`` re-exports it: most callers import it from there.)
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cluster import Cluster

__all__ = ["CostOptions"]


@dataclass(kw_only=True, frozen=True)
class CostOptions:
    """What the runtime being costed overlaps, and how much memory it leaves to the plan."""

    usable_memory_fraction: float = 0.92
    """Share of device memory the plan may use; the rest goes to the CUDA context, allocator
    fragmentation and library workspaces (~5-8% on 80 GB parts)."""
    overlap_dp: bool = True
    """Gradient reductions (DDP/ZeRO buckets) run alongside the backward that produces them, and
    ZeRO's parameter all-gather alongside the next forward (``planner.search.dp_cost``)."""
    overlap_fsdp: bool = True
    """FSDP all-gathers and reduce-scatters run under compute (needs prefetch)."""
    overlap_tp: bool = False
    """Tensor-parallel collectives overlap compute (they do not in eager Megatron-style TP)."""
    overlap_p2p: bool = False
    """Pipeline sends/receives overlap compute."""
    optimizer: str = "adam"
    """adam or sgd; sets the optimizer-state bytes per parameter (``planner.cost_memory``)."""
    moe_imbalance: float = 1.2
    """Tokens the busiest expert-parallel rank receives over the mean (routing is not uniform).
    Under expert parallelism the step waits for that rank: its expert matmuls and all-to-alls take
    this factor longer. GShard (Lepikhin et al. 2021) and Switch (Fedus et al. 2021) train with
    capacity factors of 1.0-1.25, i.e. experts sized for up to a quarter more than the mean load,
    which is also about what dropless routing with a balancing loss leaves on the busiest expert;
    1.2 sits in that range. With ep = 1 every rank runs all experts on its own tokens, so the
    imbalance moves work between a rank's experts but not between ranks."""
    zero_shard_copy: bool = False
    """ZeRO-1/2 step a separate fp32 shard of the parameters (``P/dp`` more bytes when parameters are
    fp32; with 16-bit parameters that shard is the master copy Adam's K = 12 already counts)."""
    accumulate_unsharded: bool = False
    """With several microbatches, ZeRO-2 and FSDP accumulate full (unsharded) gradients locally and
    reduce-scatter once per step (fairscale's ``no_sync``, like PyTorch FSDP's): the rank holds a
    full gradient between microbatches, and sends one reduce-scatter per step instead of one per
    microbatch."""
    runtime_mixed_precision: bool = False
    """Under a 16-bit ``param_dtype``, model states as fairscale's runtime holds them
    (``planner.cost_memory.runtime_mixed_parts``: fp32 gradients, the fp32 master counted as a
    parameter; DDP's fp32 parameters cast for compute, one set of 16-bit copies per step, saved
    for backward) instead of ZeRO §3.1's 16-bit parameters and gradients with the master in the optimizer."""
    p2p_scatter_gather: bool = False
    """Pipeline sends between nodes carry 1/tp of the activation per tensor-parallel rank, which
    then all-gather it over NVLink (Megatron-LM's scatter/gather optimization, Narayanan et al.
    2021 §4.1). Without it (and without sequence parallelism) each tp rank sends the whole tensor."""

    @classmethod
    def for_runtime(cls, cluster: Cluster) -> CostOptions:
        """What fairscale's own runtime overlaps on ``cluster``.

        * DDP / ZeRO buckets launch their all-reduce / reduce-scatter asynchronously in the last
          microbatch's backward and wait once at its end (``passes.ops.dp_ops``): overlapped on GPUs;
          on CPU ranks gloo's threads share the oversubscribed cores with compute, so exposed.
        * Tensor-parallel collectives are blocking autograd functions: not overlapped.
        * Pipeline sends are posted asynchronously but each receive waits before its compute: not overlapped.
        * ZeRO-2 and FSDP accumulate unsharded gradients over microbatches (``passes.ops.dp_ops.no_sync``).
        * ZeRO-1/2 keep the optimizer's parameter shard as its own tensor (``fairscale.runtime.optim``).
        * 16-bit plans keep fp32 gradients and masters; DDP casts its fp32 parameters once a step.
        * FSDP prefetches the next unit's all-gather asynchronously (``FSDPUnit.start_gather``):
          overlapped on GPUs (NCCL runs on its own stream); on CPU ranks gloo's transfer thread
          competes for the same oversubscribed cores, so it is counted as exposed.
        """
        cpu = cluster.device.startswith("cpu") or cluster.name.startswith("cpu")
        return cls(overlap_dp=not cpu, overlap_fsdp=not cpu, overlap_tp=False, overlap_p2p=False,
                   accumulate_unsharded=True, zero_shard_copy=True, runtime_mixed_precision=True)

    @classmethod
    def megatron2021(cls, *, torch_ddp: bool = False) -> CostOptions:
        """The runtime of Narayanan et al. 2021 (Megatron-LM's ``examples/sc21`` scripts): blocking
        tensor-parallel all-reduces and pipeline sends, the scatter/gather optimization on those
        sends, Adam. Gradients are all-reduced by Megatron's "local" DDP after the rank's last
        backward (``--DDP-impl local``), or, with ``torch_ddp``, by PyTorch DDP in buckets during
        the last microbatch's backward (``--DDP-impl torch``)."""
        return cls(overlap_dp=torch_ddp, overlap_fsdp=False, overlap_tp=False, overlap_p2p=False,
                   p2p_scatter_gather=True)
