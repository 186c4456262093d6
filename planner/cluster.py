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
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Cluster", "Efficiency", "PRESETS", "GiB", "default_compute_dtype"]

GiB = 1024**3
MiB = 1024**2


@dataclass(kw_only=True, frozen=True)
class Efficiency:
    """Fractions of datasheet peaks that real kernels reach. A small set of constants, not fitted per model.

    Defaults and their reasoning (A100/H100 era, cuBLAS + NCCL), set once before comparing with
    any published run (``benchmarks/planner/README.md`` shows how they compare):

    * ``matmul`` 0.62: cuBLAS fp16/bf16 GEMMs of large transformer shapes reach roughly 70-80% of
      peak in isolation; inside a training step the counted FLOPs also include the attention
      batched GEMMs (smaller, less efficient) and pay kernel-launch gaps and synchronization, so
      we take a bit over 60% end to end.
    * ``memory`` 0.7: elementwise and normalization kernels move about 70% of HBM bandwidth
      (STREAM-like copies reach ~1.3-1.5 TB/s of the A100's 2.0 TB/s).
    * ``network`` 0.8: NCCL ring bus bandwidth reaches about 80% of the link rate on NVLink and
      InfiniBand (nccl-tests all_reduce busbw).
    """

    matmul: float = 0.62
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
    last_node_devices: int = 0
    """Devices of the last node when it is partial (``devices=12`` on 8-GPU nodes: 4); 0 when
    every node is full. Groups of a plan never straddle the gap: tp divides the node size and the
    device count, so a tp group sits inside one node."""
    op_overhead_s: float = 0.0
    """Host seconds per executed graph op in forward (dispatch, autograd bookkeeping) that the
    device does not hide; backward pays twice as many. 0 for GPUs, whose kernels queue ahead of
    the host; tens of microseconds for CPU ranks sharing cores (``fairscale.runtime.calibrate``)."""

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
        if self.op_overhead_s < 0:
            problems.append(f"op_overhead_s must be >= 0 (got {self.op_overhead_s})")
        if problems:
            raise ValueError("invalid Cluster: " + "; ".join(problems))

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
        """The local machine: its CUDA GPUs (count, model, memory, NVLink or PCIe), else CPU ranks.

        Peaks come from the matching preset when the GPU model is known (A100, H100, H200);
        an unknown GPU gets A100-80GB peaks scaled by nothing, and its name says so.
        """
        import torch  # local: the rest of the planner never needs torch.cuda

        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return cls.cpu(max(1, os.cpu_count() or 1))
        count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        model = str(props.name)
        base = PRESETS[_preset_for(model)]
        nvlink = _has_nvlink()
        intra = base.intra_bandwidth if nvlink else 25e9  # PCIe 4.0 x16: 32 GB/s raw, ~25 GB/s achievable
        return dataclasses.replace(base, name="detected", device=model, nodes=1, devices_per_node=count,
                                   memory_bytes=int(props.total_memory), intra_bandwidth=intra)

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
        return cls(**data, efficiency=Efficiency(**eff) if eff else Efficiency())


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


def _has_nvlink() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return bool(pynvml.nvmlDeviceGetNvLinkState(handle, 0))
    except Exception:  # noqa: BLE001 - no NVML or no NVLink: assume PCIe
        return False


def _preset_for(device_name: str) -> str:
    n = device_name.upper()
    if "H200" in n:
        return "h200"
    if "H100" in n:
        return "h100-sxm-80gb"
    if "A100" in n and "40" in n:
        return "a100-40gb"
    return "a100-80gb"


# --- presets ------------------------------------------------------------------------------------
# A100 SXM4 (NVIDIA A100 Tensor Core GPU datasheet, 2021): FP32 19.5 TFLOP/s, TF32 156, BF16/FP16
#   312 (dense; 624 with sparsity); HBM2 1,555 GB/s (40GB) / HBM2e 2,039 GB/s (80GB); NVLink 3
#   600 GB/s total per GPU = 300 GB/s per direction. DGX A100 node: 8 GPUs, 8 x 200 Gb/s HDR
#   InfiniBand compute NICs (DGX A100 user guide) = 25 GB/s per GPU per direction.
# H100 SXM5 (NVIDIA H100 Tensor Core GPU datasheet): FP32 67 TFLOP/s, TF32 494.7, BF16/FP16 989.4
#   (dense; 1,979 with sparsity); HBM3 3.35 TB/s; NVLink 4 900 GB/s total = 450 GB/s per direction.
#   DGX H100: 8 GPUs, 8 x 400 Gb/s NDR ConnectX-7 = 50 GB/s per GPU per direction.
# H200 SXM (NVIDIA H200 Tensor Core GPU datasheet): same compute as H100 SXM, 141 GB HBM3e at
#   4.8 TB/s, NVLink 900 GB/s; DGX H200 keeps 8 x 400 Gb/s NDR.
# Memory sizes are what nvidia-smi reports (MiB): A100-40GB 40960, A100-80GB 81920,
#   H100-SXM-80GB 81559, H200 143771.
# Latencies: ~5 us per NVLink hop and ~10 us per InfiniBand hop are NCCL's small-message floors.
# Host side (offload): DGX A100 has PCIe 4.0 x16 per GPU (32 GB/s per direction raw, ~25 GB/s
#   achieved), 1 TB of RAM (128 GB per GPU) and two EPYC 7742 with 8 DDR4-3200 channels each
#   (2 x 204.8 GB/s = 51 GB/s per GPU); DGX H100/H200 have PCIe 5.0 x16 (64 GB/s raw, ~50 GB/s),
#   2 TB of RAM (256 GB per GPU) and two Xeon 8480C with 8 DDR5-4800 channels each (77 GB/s per GPU).

_A100 = {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}
_DGX_A100_HOST: dict[str, Any] = {"host_bandwidth": 25e9, "host_memory_bytes": 128 * 10**9,
                                  "host_memory_bandwidth": 51e9}
_DGX_H100_HOST: dict[str, Any] = {"host_bandwidth": 50e9, "host_memory_bytes": 256 * 10**9,
                                  "host_memory_bandwidth": 77e9}
_H100 = {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}

PRESETS: dict[str, Cluster] = {
    "a100-40gb": Cluster(name="a100-40gb", device="NVIDIA A100-SXM4-40GB", nodes=1, devices_per_node=8,
                         memory_bytes=40960 * MiB, peak_flops=_A100, hbm_bandwidth=1555e9,
                         intra_bandwidth=300e9, intra_latency=5e-6, inter_bandwidth=25e9, inter_latency=10e-6,
                         **_DGX_A100_HOST),
    "a100-80gb": Cluster(name="a100-80gb", device="NVIDIA A100-SXM4-80GB", nodes=1, devices_per_node=8,
                         memory_bytes=81920 * MiB, peak_flops=_A100, hbm_bandwidth=2039e9,
                         intra_bandwidth=300e9, intra_latency=5e-6, inter_bandwidth=25e9, inter_latency=10e-6,
                         **_DGX_A100_HOST),
    "h100-sxm-80gb": Cluster(name="h100-sxm-80gb", device="NVIDIA H100 80GB HBM3", nodes=1, devices_per_node=8,
                             memory_bytes=81559 * MiB, peak_flops=_H100, hbm_bandwidth=3350e9,
                             intra_bandwidth=450e9, intra_latency=5e-6, inter_bandwidth=50e9, inter_latency=10e-6,
                             **_DGX_H100_HOST),
    "h200": Cluster(name="h200", device="NVIDIA H200", nodes=1, devices_per_node=8,
                    memory_bytes=143771 * MiB, peak_flops=_H100, hbm_bandwidth=4800e9,
                    intra_bandwidth=450e9, intra_latency=5e-6, inter_bandwidth=50e9, inter_latency=10e-6,
                    **_DGX_H100_HOST),
}

_ALIASES = {"a100": "a100-80gb", "a100-80": "a100-80gb", "a100-40": "a100-40gb", "h100": "h100-sxm-80gb",
            "h100-sxm": "h100-sxm-80gb", "h100-80gb": "h100-sxm-80gb", "h200-sxm": "h200", "h200-141gb": "h200"}
