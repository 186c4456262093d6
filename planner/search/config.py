"""The search's vocabulary: a point of the search space (:class:`Config`), its predicted cost
(:class:`Breakdown`), and what stays constant during one search (:class:`Context`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from planner.cluster import Cluster
from planner.cost import CostOptions, LayerCost, LayerFacts, layer_costs
from planner.graph import ModelGraph
from planner.plan import Predicted
from planner.search.units import UnitTable, unit_table

__all__ = ["Config", "Breakdown", "Context", "STEP_TERMS"]


@dataclass(kw_only=True, frozen=True)
class Config:
    """One point of the search space (everything a Plan fixes, in index form)."""

    pp: int
    """Pipeline ranks."""
    dp: int
    """Data-parallel degree."""
    tp: int
    """Tensor-parallel degree."""
    microbatches: int
    """Microbatches per step."""
    kind: str = "1f1b"
    """Schedule: gpipe, 1f1b, interleaved or v."""
    v: int = 1
    """Chunks per pipeline rank (interleaved; 2 for v)."""
    dp_kind: str = "ddp"
    """ddp, zero1, zero2 or fsdp."""
    reshard: bool = True
    """FSDP reshard_after_forward."""
    prefetch: bool = True
    """FSDP prefetch of the next unit."""
    sp: bool = False
    """Sequence parallelism on the tp axis."""
    param_dtype: str = "fp32"
    """Compute dtype of parameters and activations."""
    reduce_dtype: str = "fp32"
    """Dtype gradients are reduced in."""
    bucket_mb: float = 25.0
    """DDP/ZeRO gradient bucket, MiB (the last bucket cannot overlap)."""
    cuts: tuple[int, ...] = ()
    """Stage boundaries as layer indices: 0 = c_0 < c_1 < … < c_{pp·v} = L."""
    recompute: frozenset[int] = frozenset()
    """Indices of fully recomputed layers."""
    selective: frozenset[int] = frozenset()
    """Indices of selectively recomputed layers (matmul/attention outputs kept; disjoint from ``recompute``)."""
    units: str | None = None
    """FSDP unit selector (``planner.search.units``; None: every repeated-block layer is a unit)."""
    offload: bool = False
    """FSDP: parameter shards, gradients and optimizer states live in host memory (CPU Adam)."""
    ep: int = 1
    """Expert parallelism: MoE experts split over groups of ep dp ranks (divides dp)."""


@dataclass(kw_only=True)
class Breakdown:
    """Predicted cost of a configuration. Seconds, bytes, FLOP/s."""

    step_time_s: float
    """One optimizer step."""
    pipeline_s: float
    """First forward to last backward."""
    bubble: float
    """Idle share of the pipeline time."""
    rank_times_s: list[float]
    """Per pipeline rank: one microbatch's forward + backward (+ recompute, TP, p2p, FSDP exposed)."""
    compute_s: float
    """Slowest rank's pure compute per step (no recompute, no communication)."""
    recompute_s: float
    """Slowest rank's recompute time per step."""
    tp_comm_s: float
    """Slowest rank's exposed tensor-parallel time per step."""
    p2p_s: float
    """Slowest rank's exposed pipeline send/receive time per step."""
    ep_comm_s: float = 0.0
    """Slowest rank's expert-parallel all-to-all time per step (MoE token dispatch and combine)."""
    dp_comm_s: float
    """Exposed data-parallel time per step (gradient sync after the flush + FSDP per microbatch)."""
    optimizer_s: float
    """Optimizer step of the slowest rank."""
    host_s: float = 0.0
    """The runtime's own host work per step on the slowest rank (``planner.cost_host.runtime_host_s``:
    per step, per microbatch, per data-parallel tensor); 0 on GPUs. Part of its rank time and tail."""
    idle_s: float = 0.0
    """Seconds per step the cores of ranks time-sharing them sit idle while ranks wait on each
    other (``Cluster.core_idle`` of the node's CPU work: ``planner.search.evaluate.shared_core_idle_s``);
    0 when every rank has its own device or core."""
    memory_bytes: list[float]
    """Peak bytes per pipeline rank."""
    memory_parts: list[dict[str, float]] = field(default_factory=list)
    """Per pipeline rank, ``memory_bytes[r]`` split into ``parameters``, ``gradients``,
    ``optimizer`` (model states after data-parallel sharding; 0 on the device when offloaded),
    ``activations`` (saved for backward by the microbatches in flight, plus the one layer a
    recompute rebuilds during backward) and ``buffers`` (temporary FSDP unshard buffers: gathered
    parameters and unsharded gradients). Bytes; the five parts sum to ``memory_bytes[r]``."""
    stage_f_s: list[float] = field(default_factory=list)
    """Per pipeline stage (``pp·v`` entries in stage order; stage k runs on rank k mod pp): one
    microbatch's forward, seconds, including exposed tensor-parallel collectives. With
    ``stage_b_s`` this is what ``planner.schedule.simulate(schedule, f_cost=..., b_cost=...)``
    takes to draw the pipeline timeline."""
    stage_b_s: list[float] = field(default_factory=list)
    """Per pipeline stage: one microbatch's backward, seconds, including recompute and exposed
    tensor-parallel collectives."""
    stage_comm_s: float = 0.0
    """Seconds of the largest pipeline send of one microbatch (``comm_cost`` for the simulator; 0 if pp = 1)."""
    memory_cap: float
    """Usable bytes per device."""
    host_memory_bytes: float = 0.0
    """Host bytes per device holding offloaded states (0 without offload)."""
    host_memory_cap: float = float("inf")
    """Usable host bytes per device."""
    comm_bytes: float
    """Bytes sent per device per step, all collectives (max over pipeline ranks)."""
    model_flops: float
    """Forward + backward FLOPs of one step of the global batch (no recompute): what MFU counts."""
    hardware_flops: float = 0.0
    """``model_flops`` plus the forwards that full recompute runs again: what HFU counts (and what
    Megatron-LM's published TFLOP/s count, Narayanan et al. 2021 eq. 3)."""
    devices: int
    """Devices the configuration uses."""
    cluster_devices: int = 0
    """Devices of the cluster (more than ``devices`` when the plan leaves some idle)."""
    peak_flops: float = 0.0
    """Dense peak FLOP/s of one device in the compute dtype (the MFU / HFU denominator)."""
    config: Config | None = None
    """What was costed."""
    notes: list[str] = field(default_factory=list)
    """Anything a reader should know (e.g. a tied weight copied on two stages)."""

    @property
    def bubble_s(self) -> float:
        """Seconds per step the pipeline's bubble takes (``bubble`` of ``pipeline_s``)."""
        return self.bubble * self.pipeline_s

    @property
    def fits(self) -> bool:
        return max(self.memory_bytes) <= self.memory_cap and self.host_memory_bytes <= self.host_memory_cap

    @property
    def shortfall(self) -> float:
        """Bytes over the cap on the fullest rank, device or host (0 when it fits)."""
        return max(0.0, max(self.memory_bytes) - self.memory_cap, self.host_memory_bytes - self.host_memory_cap)

    @property
    def tflops_per_device(self) -> float:
        """Model TFLOP/s per device (no recompute counted)."""
        return self.model_flops / self.step_time_s / self.devices / 1e12 if self.step_time_s > 0 else 0.0

    @property
    def hardware_tflops_per_device(self) -> float:
        """TFLOP/s per device the hardware executes, recomputed forwards included."""
        flops = self.hardware_flops or self.model_flops
        return flops / self.step_time_s / self.devices / 1e12 if self.step_time_s > 0 else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization: model TFLOP/s over the device's peak in the compute dtype."""
        return self.tflops_per_device * 1e12 / self.peak_flops if self.peak_flops > 0 else 0.0

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilization: executed TFLOP/s (recompute included) over the peak."""
        return self.hardware_tflops_per_device * 1e12 / self.peak_flops if self.peak_flops > 0 else 0.0

    @property
    def predicted(self) -> Predicted:
        """The prediction a Plan stores."""
        return Predicted(step_time_s=self.step_time_s, tflops_per_device=self.tflops_per_device,
                         hardware_tflops_per_device=self.hardware_tflops_per_device, mfu=self.mfu, hfu=self.hfu,
                         memory_gib=[m / 2**30 for m in self.memory_bytes], comm_gib_per_step=self.comm_bytes / 2**30,
                         bubble=self.bubble, devices_used=self.devices,
                         notes=list(self.notes))


STEP_TERMS: tuple[tuple[str, str], ...] = (  # (Breakdown attribute, label): seconds per step, in report order
    ("compute_s", "compute"),
    ("recompute_s", "recompute"),
    ("tp_comm_s", "tensor-parallel collectives"),
    ("ep_comm_s", "expert all-to-all"),
    ("bubble_s", "pipeline bubble"),
    ("p2p_s", "pipeline send/receive"),
    ("dp_comm_s", "data-parallel collectives (exposed)"),
    ("optimizer_s", "optimizer step"),
    ("host_s", "runtime host work"),
    ("idle_s", "cores idle (ranks sharing cores)"),
)
"""The per-step terms of a :class:`Breakdown` (fields and derived properties) that plan
comparisons list: ``fairscale.whatif``'s diff, the search's loss reasons."""


class Context:
    """Everything constant during one search: facts, cluster, options, batch, and a cost cache."""

    def __init__(self, facts: list[LayerFacts], cluster: Cluster, *, global_batch: int,
                 options: CostOptions, captured_dtype: str,
                 facts_for_tp: Callable[[int], list[LayerFacts]] | None = None,
                 graph: ModelGraph | None = None) -> None:
        self.facts = facts
        self.graph = graph
        """The captured model (module paths and parameter shapes for FSDP units); None for bare facts."""
        self._units: dict[str | None, UnitTable] = {}
        self._ties: dict[int, list[tuple[int, int, float]]] = {}
        """Facts without tensor parallelism (names, FLOPs, bytes are the same under any tp)."""
        self._facts_for_tp = facts_for_tp
        self._by_tp: dict[int, list[LayerFacts]] = {1: facts}
        self.cluster = cluster
        self.global_batch = global_batch
        self.options = options
        self.captured_dtype = captured_dtype
        self.cap = cluster.memory_bytes * options.usable_memory_fraction
        self.host_cap = cluster.host_memory_bytes * options.usable_memory_fraction
        self.model_flops = sum(f.flops_fwd + f.flops_bwd for f in facts) * global_batch
        self.blocks = frozenset(f.index for f in facts if f.block is not None)
        self._costs: dict[tuple[int, int, str, bool], list[LayerCost]] = {}

    def ties(self, tp: int) -> list[tuple[int, int, float]]:
        """(user layer, owner layer, elements on a rank) of every tied weight a layer uses but
        another owns, at tensor-parallel degree ``tp`` (cached)."""
        if tp not in self._ties:
            self._ties[tp] = [(f.index, owner, count / (tp if f.tp.sharded and tp > 1 else 1))
                              for f in self.facts_for(tp) for owner, count in f.tied]
        return self._ties[tp]

    def units(self, text: str | None) -> UnitTable:
        """The FSDP unit table for selector ``text`` (None: the repeated blocks), cached."""
        if text not in self._units:
            f = self.facts
            self._units[text] = unit_table(self.graph, [x.name for x in f], [x.block for x in f],
                                           [x.params for x in f], text)
        return self._units[text]

    def facts_for(self, tp: int) -> list[LayerFacts]:
        """Facts with the tensor-parallel rules used at degree ``tp``."""
        if tp not in self._by_tp:
            self._by_tp[tp] = self._facts_for_tp(tp) if self._facts_for_tp is not None else self.facts
        return self._by_tp[tp]

    def costs(self, tp: int, micro: int, dtype: str, sp: bool) -> list[LayerCost]:
        key = (tp, micro, dtype, sp)
        if key not in self._costs:
            self._costs[key] = layer_costs(self.facts_for(tp), self.cluster, tp=tp, micro=micro, compute_dtype=dtype,
                                           captured_dtype=self.captured_dtype, sequence_parallel=sp,
                                           options=self.options)
        return self._costs[key]

    def micro(self, cfg: Config) -> int:
        per = self.global_batch // (cfg.dp * cfg.microbatches)
        if per * cfg.dp * cfg.microbatches != self.global_batch or per < 1:
            raise ValueError(f"global batch {self.global_batch} does not divide into dp({cfg.dp}) × "
                             f"microbatches({cfg.microbatches}) = {cfg.dp * cfg.microbatches} equal microbatches")
        return per
