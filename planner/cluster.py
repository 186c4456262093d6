"""The cluster model: what devices the planner plans for, and how fast they compute and talk.

Usage::

    from planner.cluster import Cluster
    c = Cluster.preset("a100-80gb", nodes=128)      # 1024 GPUs, DGX A100 nodes
    c = Cluster.preset("a100-80gb", devices=12)     # one full node and a partial one of 4
    c = Cluster.detect()                            # local GPUs, or CPU ranks when there are none
    c = Cluster.cpu(4)                              # 4 gloo ranks on this machine
    Cluster.from_dict(c.to_dict()) == c             # a plan records the cluster it was made for

Units everywhere: bytes, seconds, FLOP/s, bytes/s. Bandwidths are per device and per direction
(what one rank can push into a link while every other rank does the same), which is the
``busbw`` that nccl-tests reports and what the alpha-beta collective formulas in
``planner.cost_comm`` expect.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
import warnings
from typing import Any, Callable, Mapping

from planner.detect import INTER_NODE, GpuInfo, intra_node_link, node_shape, probe_gpu
from planner.gpus import GPU_MODELS, conservative_model, gpu_model

__all__ = ["Cluster", "Efficiency", "PRESETS", "GiB", "default_compute_dtype", "detect_cluster", "COLLECTIVE_LINK_OPS",
           "WHOLE_OP_KINDS", "link_at"]

GiB = 1024**3
MiB = 1024**2
COLLECTIVE_LINK_OPS = ("all_gather", "reduce_scatter", "p2p")
"""The operations ``Cluster.collective_links`` may give a link of their own."""
WHOLE_OP_KINDS = ("norm", "elementwise")
"""The kinds of op ``Cluster.whole_op_s`` prices per byte (``planner.cost_whole``)."""


@dataclass(kw_only=True, frozen=True)
class Efficiency:
    """Fractions of datasheet peaks that real kernels reach. A small set of constants, not fitted per model.

    Defaults and their reasoning (A100/H100 era, cuBLAS + NCCL), set once before comparing with
    any published run (``benchmarks/planner/README.md`` shows how they compare):

    * ``matmul`` 0.70: cuBLAS fp16/bf16 GEMMs of transformer shapes reach roughly 70-80% of peak
      in isolation (large square ones more; the tp-split and short-K shapes of training less); we
      take the lower end, for the launch gaps between kernels. Unfused attention's batched matmuls
      are slower, but what slows them (their s×s scores through HBM) is costed apart, as memory
      traffic on top of their FLOPs (``planner.cost.layer_costs``), so it is not folded in here.
      Until 2026-11-27 it was (0.62, a blend of GEMMs, attention matmuls and gaps); a blend cannot
      follow attention's share of the FLOPs, s/(6h) (13% at h = 2304, 1.3% at h = 25600), and
      against Megatron-LM's Table 1 its error grew with the model (−3% at 1.7B, +11% at 1T).
      Fused (flash) attention's FLOPs count at this rate too: FlashAttention-2 reaches 50-73% of
      the A100's peak (Dao 2023), so attention-heavy shapes come out a little optimistic.
      A check outside Table 1: Korthikanti et al. 2022 report 54.2% model FLOPs utilization for a
      530B GPT on 2240 A100s end to end (bubble, tensor-parallel all-reduces and memory-bound
      kernels included), so its GEMMs ran above that.
    * ``memory`` 0.7: elementwise and normalization kernels move about 70% of HBM bandwidth
      (STREAM-like copies reach ~1.3-1.5 TB/s of the A100's 2.0 TB/s).
    * ``network`` 0.8: NCCL ring bus bandwidth reaches about 80% of the link rate on NVLink and
      InfiniBand (nccl-tests all_reduce busbw).
    """

    matmul: float = 0.70
    """Fraction of peak FLOP/s for the FLOPs the capture counts (GEMMs, attention)."""
    memory: float = 0.7
    """Fraction of HBM bandwidth for memory-bound (elementwise, normalization) work."""
    network: float = 0.8
    """Fraction of link bandwidth that collectives reach (bus bandwidth / link rate)."""

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass(kw_only=True, frozen=True)
class Cluster:
    """Devices, their peaks, and the two-level fabric (inside a node, between nodes)."""

    name: str
    """Preset name (``a100-80gb``), ``cpu`` or ``detected``."""
    device: str
    """Device model, e.g. ``NVIDIA A100-SXM4-80GB``."""
    nodes: int
    """Number of nodes."""
    devices_per_node: int
    """Devices (GPUs, or CPU ranks) per node."""
    memory_bytes: int
    """Memory per device, bytes (what the device reports, before the allocator's reserve)."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per compute dtype: keys fp32, tf32, bf16, fp16."""
    hbm_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    intra_bandwidth: float
    """Per-device, per-direction bandwidth between devices of one node (NVLink, PCIe, shared memory), bytes/s."""
    intra_latency: float
    """Latency of one message inside a node, seconds (the alpha of the alpha-beta model)."""
    inter_bandwidth: float
    """Per-device, per-direction bandwidth between nodes (each GPU's share of the node's NICs), bytes/s."""
    inter_latency: float
    """Latency of one message between nodes, seconds."""
    efficiency: Efficiency = field(default_factory=Efficiency)
    """Achievable fractions of the peaks above."""
    host_bandwidth: float = 25e9
    """Per-device, per-direction bandwidth between the device and host memory (PCIe), bytes/s."""
    host_memory_bytes: int = 128 * 2**30
    """Host (CPU) memory per device, bytes: the node's RAM divided by its devices."""
    host_memory_bandwidth: float = 50e9
    """Host DRAM bandwidth per device (the node's divided by its devices), bytes/s; bounds a CPU optimizer step."""
    shared_cores: int = 0
    """CPU cores that the ranks of a node time-share (0: every device computes on its own, as
    GPUs do). With fewer cores than ranks, the rates above are what a rank gets while all ranks
    compute; a rank that waits (pipeline bubble, a receive) frees its share for the others
    (``planner.search.evaluate.shared_core_pipeline_time``)."""
    core_idle: float = 0.0
    """How much longer than its CPU work over the shared cores a step of time-sharing ranks takes,
    as a fraction (0.1: 10% longer): cores left idle while ranks wait on each other (a collective's
    early arrivals, the scheduler waking a rank whose message came). The cost model charges it on
    the node's CPU work (``planner.search.evaluate.shared_core_idle_s``). 0 when the ranks do not
    share cores (GPUs); measured for CPU ranks by calibration on real ``train_step`` calls, as the
    cores' idle seconds over the ranks' CPU seconds (``fairscale.calibrate_host``: 6-9% in three
    calibrations of 8 ranks on 2 cores)."""
    last_node_devices: int = 0
    """Devices of the last node when it is partial (``devices=12`` on 8-GPU nodes: 4); 0 when
    every node is full. Groups of a plan never straddle the gap: tp divides the node size and the
    device count, so a tp group sits inside one node."""
    op_overhead_s: float = 0.0
    """Host seconds per executed graph op in forward (dispatch, autograd bookkeeping) that the
    device does not hide; backward pays twice as many. 0 for GPUs, whose kernels queue ahead of
    the host; tens of microseconds for CPU ranks sharing cores (``fairscale.runtime.calibrate``)."""
    optimizer_tensor_s: float = 0.0
    """Host seconds per parameter tensor an optimizer step updates (Adam runs about a dozen small
    ops per tensor, each paying dispatch): what a step of many small tensors costs beyond its
    bytes. 0 for GPUs (hidden behind the kernels); measured for CPU ranks by calibration."""
    recompute_op_s: float = 0.0
    """Host seconds per graph op that full recomputation of a layer adds (its forward run again under
    checkpointing, with the saved-tensor hooks of both runs); 0: one forward's ``op_overhead_s`` per
    op. Measured for CPU ranks by calibration (``planner.cost_host.recompute_host_s``)."""
    collective_call_s: dict[str, dict[int, float]] = field(default_factory=dict)
    """``all_reduce`` / ``all_gather`` -> group size -> host seconds one small call costs a rank
    (CPU ranks: calibration's CPU time per call times the ranks per core, every rank in a group at
    once). Empty for GPUs: the link latency is used. ``planner.cost_host.tp_link`` reads it."""
    collective_links: dict[str, tuple[float, float]] = field(default_factory=dict)
    """``all_gather`` / ``reduce_scatter`` / ``p2p`` -> (bandwidth bytes/s, latency s) of that
    collective inside a node, where it is measured apart from the link (CPU gloo ranks: calibration
    fits each collective on its own, and gloo's reduce-scatter moves bytes several times slower than
    its all-reduce). ``p2p`` is one pipeline send as the runtime posts it: a batch of a send and the
    receive paired with it, ``latency + bytes / bandwidth`` per send (a rank receives as many
    messages as it sends). Empty for GPUs: every collective uses the intra-node link.
    ``planner.cost_comm.comm_group`` and ``planner.search.ranks.stage_send`` read it."""
    collective_ranges: dict[str, tuple[tuple[float, float, float], ...]] = field(default_factory=dict)
    """``all_gather`` / ``reduce_scatter`` / ``p2p`` -> rows ``(up to bytes, bandwidth bytes/s,
    latency s)``, ascending: that op's link inside a node fitted per size range, between each two
    consecutive message sizes calibration measured (gloo's cost per byte changes several-fold
    between 4 KiB and 16 MiB: one line through all sizes was 2.4× off in the middle, and ZeRO-2 and
    FSDP plans, whose buckets sit there, were predicted 40% slow). A message of ``n`` bytes
    (``planner.cost_comm``'s convention) takes the first row reaching ``n``, the last beyond them.
    Where an op has rows they replace its ``collective_links`` entry (the one-line fit, kept for
    the report). Empty for GPUs. Read through :meth:`link_rows`."""
    step_host_s: float = 0.0
    """Host seconds the runtime spends per training step on every rank outside the graph's ops,
    the collectives and the optimizer's arithmetic: ``train_step``'s own machinery (gradients
    zeroed, the batch cut, the loss gathered, the optimizer wrapper). 0 for GPUs (hidden behind
    the kernels); measured for CPU ranks by calibration on real ``train_step`` calls
    (``planner.cost_host.runtime_host_s``)."""
    microbatch_host_s: float = 0.0
    """Host seconds per microbatch per stage chunk a rank runs: the pipeline engine's forward and
    backward actions (the stage call, the loss, posting sends and receives). 0 for GPUs; measured
    for CPU ranks by calibration."""
    dp_tensor_host_s: float = 0.0
    """Host seconds per parameter tensor per step that data parallelism adds (gradient hooks,
    copies into and out of the buckets). 0 for GPUs; measured for CPU ranks by calibration."""
    tp_op_host_s: float = 0.0
    """Host seconds per tensor-parallel collective op of a microbatch outside its wait: the
    runtime's op around the gloo call (its autograd function, the copies around the call, the
    gloo threads' work before the wait). Charged with the layer's compute
    (``planner.cost_host.tp_op_calls``). 0 for GPUs; measured for CPU ranks by calibration."""
    gemm_flops: tuple[tuple[int, int, float, int], ...] = ()
    """(in features, out features, FLOP/s, rows) of a linear's forward+backward by weight shape and
    rows, every rank at once: a tensor-parallel rank's narrower GEMMs run slower per FLOP on CPU
    ranks, the more so on few rows, and ``planner.cost_gemm.tp_gemm_factor`` charges a split
    layer's GEMMs the ratio of these rates at its rows. Rows 0: not recorded (a file written before
    calibration version 11 lists ``(in, out, FLOP/s)``; read by weight size alone). Empty for GPUs
    (the factor is 1); measured for CPU ranks by calibration."""
    whole_op_s: dict[str, float] = field(default_factory=dict)
    """``norm`` / ``elementwise`` -> seconds per byte of output of a layer norm's / an add's forward
    +backward beyond its per-op cost (every rank at once): what the ops a tensor-parallel rank runs
    on whole activations cost (``planner.cost_whole``). Empty for GPUs; measured for CPU ranks."""

    def __post_init__(self) -> None:
        problems = []
        if self.nodes < 1 or self.devices_per_node < 1:
            problems.append(f"nodes ({self.nodes}) and devices_per_node ({self.devices_per_node}) must be >= 1")
        for key in ("fp32", "bf16", "fp16"):
            if self.peak_flops.get(key, 0.0) <= 0:
                problems.append(f"peak_flops[{key!r}] must be > 0 (got {self.peak_flops.get(key)})")
        for key in ("memory_bytes", "hbm_bandwidth", "intra_bandwidth", "inter_bandwidth", "host_bandwidth",
                    "host_memory_bytes", "host_memory_bandwidth"):
            if getattr(self, key) <= 0:
                problems.append(f"{key} must be > 0 (got {getattr(self, key)})")
        if not 0 <= self.last_node_devices < self.devices_per_node:
            problems.append(f"last_node_devices must be in 0..{self.devices_per_node - 1} (0: the last node is "
                            f"full), got {self.last_node_devices}")
        if self.shared_cores < 0:
            problems.append(f"shared_cores must be >= 0 (got {self.shared_cores})")
        if self.core_idle < 0:
            problems.append(f"core_idle must be >= 0 (got {self.core_idle})")
        for key in ("op_overhead_s", "optimizer_tensor_s", "recompute_op_s", "step_host_s", "microbatch_host_s",
                    "dp_tensor_host_s", "tp_op_host_s"):
            if getattr(self, key) < 0:
                problems.append(f"{key} must be >= 0 (got {getattr(self, key)})")
        if any(len(g) != 4 or g[0] < 1 or g[1] < 1 or g[2] <= 0 or g[3] < 0 for g in self.gemm_flops):
            problems.append(f"gemm_flops needs (in >= 1, out >= 1, FLOP/s > 0, rows >= 0) entries (got {self.gemm_flops})")
        if any(k not in WHOLE_OP_KINDS or v < 0 for k, v in self.whole_op_s.items()):
            problems.append(f"whole_op_s maps norm / elementwise to seconds per byte >= 0 (got {self.whole_op_s})")
        bad = {op: calls for op, calls in self.collective_call_s.items()
               if any(g < 2 or t < 0 for g, t in calls.items())}
        if bad:
            problems.append(f"collective_call_s needs group sizes >= 2 and seconds >= 0 (got {bad})")
        odd = {op: link for op, link in self.collective_links.items()
               if op not in COLLECTIVE_LINK_OPS or link[0] <= 0 or link[1] < 0}
        if odd:
            problems.append("collective_links maps all_gather / reduce_scatter / p2p to (bandwidth > 0, latency >= 0) "
                            f"(got {odd})")
        for op, rows in self.collective_ranges.items():
            ends = [r[0] for r in rows]
            if (op not in COLLECTIVE_LINK_OPS or not rows or ends != sorted(ends)
                    or any(end <= 0 or bw <= 0 or lat < 0 for end, bw, lat in rows)):
                problems.append(f"collective_ranges[{op!r}] must be an op of {list(COLLECTIVE_LINK_OPS)} with rows "
                                f"(up to bytes > 0, ascending; bandwidth > 0; latency >= 0) (got {rows})")
        if problems:
            raise ValueError("invalid Cluster: " + "; ".join(problems))

    def link_rows(self, op: str) -> tuple[tuple[float, float, float], ...]:
        """``(up to bytes, bandwidth, latency)`` rows of collective ``op`` inside a node, bandwidth
        × network efficiency: its per-range fit, else its one-line link, else the intra-node link
        (one row reaching any size)."""
        eff = self.efficiency.network
        if op in self.collective_ranges:
            return tuple((end, bw * eff, lat) for end, bw, lat in self.collective_ranges[op])
        bw, lat = self.collective_links.get(op, (self.intra_bandwidth, self.intra_latency))
        return ((math.inf, bw * eff, lat),)

    @property
    def devices(self) -> int:
        """Total number of devices (the last node may be partial)."""
        return (self.nodes - 1) * self.devices_per_node + (self.last_node_devices or self.devices_per_node)

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (fp32, tf32, bf16, fp16)."""
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ValueError(f"cluster {self.name!r} has no peak for dtype {dtype!r}; "
                             f"it knows {sorted(self.peak_flops)}") from None

    def compute_flops(self, dtype: str) -> float:
        """The peak a plan computing in ``dtype`` runs its matmuls at: :meth:`flops`, except that fp32
        on GPUs runs in TF32 (the runtime enables it unless the user chose IEEE fp32:
        ``fairscale.runtime.device.enable_tf32``; seen on an H200, an fp32 plan's matmuls ran at 6×
        the fp32 peak). CPU ranks have no TF32."""
        if dtype == "fp32" and self.device != "cpu" and "tf32" in self.peak_flops:
            return self.peak_flops["tf32"]
        return self.flops(dtype)

    def link(self, span: int) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of the slowest link a group of ``span`` consecutive
        devices crosses: inside a node when the span fits in one node, else between nodes."""
        if span <= self.devices_per_node:
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency

    @property
    def core_share(self) -> float:
        """Ranks per core when a node's ranks time-share fewer cores than there are ranks, else 1."""
        if self.shared_cores and self.shared_cores < self.devices_per_node:
            return self.devices_per_node / self.shared_cores
        return 1.0

    def with_nodes(self, nodes: int) -> Cluster:
        return dataclasses.replace(self, nodes=nodes, last_node_devices=0)

    def with_devices(self, devices: int) -> Cluster:
        """The same hardware with ``devices`` devices: full nodes and, for a remainder, a partial last node."""
        if devices < 1:
            raise ValueError(f"devices must be >= 1, got {devices}")
        per = self.devices_per_node
        return dataclasses.replace(self, nodes=-(-devices // per), last_node_devices=devices % per)

    # --- construction ----------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, *, nodes: int | None = None, devices: int | None = None) -> Cluster:
        """A named system (``a100-40gb``, ``a100-80gb``, ``h100-sxm-80gb``, ``h200``) with ``nodes``
        nodes (default 1), or with ``devices`` devices: as many full nodes as fit and a partial last
        node for the remainder (``devices=6`` on 8-GPU nodes is one node of 6)."""
        key = name.lower().replace("_", "-")
        key = _ALIASES.get(key, key)
        if key not in PRESETS:
            raise ValueError(f"unknown cluster preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
        if nodes is not None and nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        base = PRESETS[key]
        if devices is None:
            return dataclasses.replace(base, nodes=nodes or 1)
        sized = base.with_devices(devices)
        if nodes is not None and nodes != sized.nodes:
            raise ValueError(f"{devices} devices of {base.name} ({base.devices_per_node} per node) take "
                             f"{sized.nodes} node(s), not {nodes}; give one of nodes= and devices=, or make them agree")
        return sized

    @classmethod
    def cpu(cls, ranks: int, *, memory_bytes: int | None = None) -> Cluster:
        """``ranks`` gloo ranks on this machine (one node). Memory is the host's RAM split evenly.

        The CPU peaks are rough (a few tens of GFLOP/s per core with AVX2 FMA, a few GB/s for gloo
        over shared memory); they only need to rank plans sensibly for the CPU demo.
        """
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        host = memory_bytes if memory_bytes is not None else host_memory_bytes() // ranks
        cores = max(1, (os.cpu_count() or 1))
        per_rank = 50e9 * max(1.0, cores / ranks)
        return cls(name="cpu", device="cpu", nodes=1, devices_per_node=ranks, memory_bytes=host,
                   peak_flops={"fp32": per_rank, "tf32": per_rank, "bf16": per_rank / 2, "fp16": per_rank / 4},
                   hbm_bandwidth=10e9, intra_bandwidth=2e9, intra_latency=20e-6,
                   inter_bandwidth=1e9, inter_latency=50e-6, host_bandwidth=10e9, host_memory_bytes=host,
                   host_memory_bandwidth=10e9)

    @classmethod
    def detect(cls) -> Cluster:
        """The local machine: its GPUs (count, model, memory, NVLink or PCIe; nodes from the
        launcher's ``WORLD_SIZE``/``LOCAL_WORLD_SIZE``), else CPU ranks. Creates no CUDA context;
        an unknown GPU model is named as unknown and planned with conservative figures, with a
        warning (``planner.detect``)."""
        return detect_cluster()

    # --- serialization -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["efficiency"] = self.efficiency.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        """Inverse of :meth:`to_dict`. A dict holding only ``preset`` (and ``nodes`` or ``devices``) names a preset."""
        data = dict(data)
        if set(data) <= {"preset", "nodes", "devices"} and "preset" in data:
            nodes, devices = data.get("nodes"), data.get("devices")
            return cls.preset(str(data["preset"]), nodes=int(nodes) if nodes is not None else None,
                              devices=int(devices) if devices is not None else None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in data and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if unknown or missing:
            raise ValueError(f"cannot read cluster: unknown keys {unknown}, missing keys {missing}")
        eff = data.pop("efficiency", None)
        data["peak_flops"] = {str(k): float(v) for k, v in data["peak_flops"].items()}
        data["collective_call_s"] = {str(op): {int(g): float(t) for g, t in calls.items()}
                                     for op, calls in data.get("collective_call_s", {}).items()}
        data["collective_links"] = {str(op): (float(bw), float(lat))
                                    for op, (bw, lat) in data.get("collective_links", {}).items()}
        data["collective_ranges"] = {str(op): tuple((float(end), float(bw), float(lat)) for end, bw, lat in rows)
                                     for op, rows in data.get("collective_ranges", {}).items()}
        data["whole_op_s"] = {str(k): float(v) for k, v in data.get("whole_op_s", {}).items()}
        data["gemm_flops"] = tuple((int(g[0]), int(g[1]), float(g[2]), int(g[3]) if len(g) > 3 else 0)
                                   for g in data.get("gemm_flops", ()))  # before version 11: no rows
        return cls(**data, efficiency=Efficiency(**eff) if eff else Efficiency())


def link_at(rows: tuple[tuple[float, float, float], ...], nbytes: float) -> tuple[float, float]:
    """(bandwidth, latency) of the first of :meth:`Cluster.link_rows`' rows reaching ``nbytes``,
    the last beyond them all. Example: rows ((64e3, 1e8, 1e-3), (4e6, 5e8, 2e-3)): 1 KB -> (1e8,
    1e-3), 1 MB and 16 MB -> (5e8, 2e-3)."""
    for end, bandwidth, latency in rows:
        if nbytes <= end:
            return bandwidth, latency
    return rows[-1][1], rows[-1][2]


def detect_cluster(*, gpus: Callable[[], int] | None = None, probe: Callable[[], GpuInfo | None] | None = None,
                   environ: Mapping[str, str] | None = None) -> Cluster:
    """The local cluster, as ``planner.detect`` describes. ``gpus``, ``probe`` and ``environ`` replace the
    GPU count, the driver query and ``os.environ`` (tests fake them)."""
    env = os.environ if environ is None else environ
    if gpus is None:
        import torch  # local: the rest of the planner never needs torch.cuda

        count = torch.cuda.device_count()  # NVML: no CUDA context
    else:
        count = gpus()
    if count == 0:
        world = int(env.get("WORLD_SIZE", "0")) or max(1, os.cpu_count() or 1)
        return Cluster.cpu(world)
    info = (probe or probe_gpu)()
    if info is None:
        raise RuntimeError(f"{count} CUDA device(s) are visible but neither NVML nor torch.cuda could name them; "
                           "install nvidia-ml-py (pip install fairscale[gpu]) or pass cluster= (a preset name, "
                           "e.g. 'h100-sxm-80gb', or a planner.cluster.Cluster)")
    nodes, per_node = node_shape(count, env)
    model = gpu_model(info.name)
    notes = []
    if model is None:
        model = conservative_model(info.name, info.memory_bytes)
        notes.append(f"unknown GPU model {info.name!r}: planning with conservative figures (the lowest of every "
                     f"known model: {model.peak_flops['bf16'] / 1e12:.0f} TFLOP/s bf16, "
                     f"{model.hbm_bandwidth / 1e9:.0f} GB/s memory, PCIe Gen4 between GPUs); add its datasheet "
                     "figures to planner.gpus.GPU_MODELS or pass cluster=")
    intra, note = intra_node_link(model, info, per_node)
    if note:
        notes.append(note)
    if nodes > 1:
        notes.append(f"{nodes} nodes: the bandwidth between nodes cannot be measured from one node; assuming "
                     f"{INTER_NODE / 1e9:.0f} GB/s per GPU (one 400 Gb/s NIC per GPU); pass cluster= to plan for "
                     "another network")
    for text in notes:
        warnings.warn(text, stacklevel=3)
    host = host_memory_bytes() // per_node
    device = info.name if model.key != "unknown" else f"unknown: {info.name}"
    return Cluster(name="detected", device=device, nodes=nodes, devices_per_node=per_node,
                   memory_bytes=int(info.memory_bytes or model.memory_bytes), peak_flops=dict(model.peak_flops),
                   hbm_bandwidth=model.hbm_bandwidth, intra_bandwidth=intra, intra_latency=5e-6,
                   inter_bandwidth=INTER_NODE, inter_latency=10e-6, host_bandwidth=model.host_bandwidth,
                   host_memory_bytes=max(1, host))


def default_compute_dtype(cluster: Cluster) -> str:
    """The compute dtype a plan uses unless told otherwise: mixed precision on GPUs, as Megatron-LM
    and torchtitan train (16-bit parameters and activations, fp32 master weights and Adam states,
    gradients reduced in fp32): ``bf16`` where the device has bf16 tensor cores (its bf16 peak
    beats fp32), else ``fp16`` (V100; it needs loss scaling), else ``fp32``. CPU ranks stay ``fp32``
    (bf16 on CPU is slower than fp32, and fairscale's CPU runs are exactness checks)."""
    if cluster.device.startswith("cpu") or cluster.name.startswith("cpu"):
        return "fp32"
    fp32 = cluster.peak_flops.get("fp32", 0.0)
    if cluster.peak_flops.get("bf16", 0.0) > fp32:
        return "bf16"
    if cluster.peak_flops.get("fp16", 0.0) > fp32:
        return "fp16"
    return "fp32"


def host_memory_bytes() -> int:
    """Total host RAM from /proc/meminfo (16 GiB where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * GiB


# --- presets ------------------------------------------------------------------------------------
# GPU figures (peaks, memory, NVLink, PCIe) come from planner.gpus, with their sources. Node figures:
# DGX A100: 8 GPUs, 8 x 200 Gb/s HDR InfiniBand compute NICs (DGX A100 user guide) = 25 GB/s per GPU
#   per direction; DGX H100/H200: 8 x 400 Gb/s NDR ConnectX-7 = 50 GB/s per GPU per direction.
# Latencies: ~5 us per NVLink hop and ~10 us per InfiniBand hop are NCCL's small-message floors.
# Host side (offload): DGX A100 has PCIe 4.0 x16 per GPU (32 GB/s per direction raw, ~25 GB/s
#   achieved), 1 TB of RAM (128 GB per GPU) and two EPYC 7742 with 8 DDR4-3200 channels each
#   (2 x 204.8 GB/s = 51 GB/s per GPU); DGX H100/H200 have PCIe 5.0 x16 (64 GB/s raw, ~50 GB/s),
#   2 TB of RAM (256 GB per GPU) and two Xeon 8480C with 8 DDR5-4800 channels each (77 GB/s per GPU).

_DGX_A100_HOST: dict[str, Any] = {"host_memory_bytes": 128 * 10**9, "host_memory_bandwidth": 51e9}
_DGX_H100_HOST: dict[str, Any] = {"host_memory_bytes": 256 * 10**9, "host_memory_bandwidth": 77e9}


def _dgx(name: str, gpu: str, *, inter_bandwidth: float, host: dict[str, Any]) -> Cluster:
    """A DGX-style node of 8 ``gpu`` (a ``planner.gpus.GPU_MODELS`` key) on NVSwitch, with one NIC per GPU."""
    m = GPU_MODELS[gpu]
    return Cluster(name=name, device=m.example_name, nodes=1, devices_per_node=8, memory_bytes=m.memory_bytes,
                   peak_flops=dict(m.peak_flops), hbm_bandwidth=m.hbm_bandwidth, intra_bandwidth=m.nvlink_bandwidth,
                   intra_latency=5e-6, inter_bandwidth=inter_bandwidth, inter_latency=10e-6,
                   host_bandwidth=m.host_bandwidth, **host)


PRESETS: dict[str, Cluster] = {
    "a100-40gb": _dgx("a100-40gb", "a100-sxm-40gb", inter_bandwidth=25e9, host=_DGX_A100_HOST),
    "a100-80gb": _dgx("a100-80gb", "a100-sxm-80gb", inter_bandwidth=25e9, host=_DGX_A100_HOST),
    "h100-sxm-80gb": _dgx("h100-sxm-80gb", "h100-sxm", inter_bandwidth=50e9, host=_DGX_H100_HOST),
    "h200": _dgx("h200", "h200", inter_bandwidth=50e9, host=_DGX_H100_HOST),
}

_ALIASES = {"a100": "a100-80gb", "a100-80": "a100-80gb", "a100-40": "a100-40gb", "h100": "h100-sxm-80gb",
            "h100-sxm": "h100-sxm-80gb", "h100-80gb": "h100-sxm-80gb", "h200-sxm": "h200", "h200-141gb": "h200"}
