"""The GPU models the planner knows: peak FLOP/s per dtype, memory, and intra-node fabric.

Usage::

    from planner.gpus import gpu_model
    m = gpu_model("NVIDIA H100 80GB HBM3")     # -> GPU_MODELS["h100-sxm"]
    m.peak_flops["bf16"], m.memory_bytes, m.fabric
    gpu_model("NVIDIA GeForce RTX 4090")       # -> None: unknown (detection warns, never guesses)

Each model is matched by a regular expression on the name the driver reports (NVML's
``nvmlDeviceGetName``, which ``nvidia-smi`` and ``torch.cuda.get_device_name`` print too), tried in
table order, most specific first (``H100 NVL`` before ``H100 PCIe`` before the SXM part). Grace
Hopper (``GH200``), the H800 and H20 are different parts and stay unknown.

Units: bytes, FLOP/s, bytes/s. FLOP/s are **dense** tensor-core peaks (the datasheets' "with
sparsity" figures halved), fp32 on CUDA cores. Bandwidths between GPUs are per GPU and per
direction, as ``planner.cluster.Cluster`` expects (NVLink's "total" figures count both directions:
900 GB/s total = 450 GB/s each way). Sources, per row:

* A100 SXM4 and PCIe, 40 and 80 GB: NVIDIA A100 Tensor Core GPU datasheet (2021): FP32 19.5 TFLOP/s,
  TF32 156, BF16/FP16 312; HBM2 1,555 GB/s (40 GB), HBM2e 2,039 GB/s (80 GB SXM), 1,935 GB/s (80 GB
  PCIe); NVLink 3 600 GB/s total (SXM via NVSwitch; PCIe cards: an optional 2-GPU bridge);
  PCIe Gen4 x16.
* H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet: FP32 67, TF32 494.7, BF16/FP16 989.4; HBM3
  3.35 TB/s; NVLink 4 900 GB/s total via NVSwitch; PCIe Gen5. H100 PCIe: FP32 51, TF32 378, BF16/FP16
  756; HBM2e 2.0 TB/s; optional NVLink bridge (pairs) 600 GB/s. H100 NVL (per GPU): FP32 60, TF32
  417.5, BF16/FP16 835.5; 94 GB HBM3 at 3.9 TB/s; NVLink bridge (pairs) 600 GB/s; PCIe Gen5.
* H200 SXM: NVIDIA H200 Tensor Core GPU datasheet: the H100 SXM's compute; 141 GB HBM3e at 4.8 TB/s;
  NVLink 900 GB/s total. H200 NVL: FP32 60, TF32 417.5, BF16/FP16 835.5; 141 GB at 4.8 TB/s; 2- or
  4-way NVLink bridge 900 GB/s.
* L40S: NVIDIA L40S datasheet: FP32 91.6, TF32 183, BF16/FP16 362.05; 48 GB GDDR6 at 864 GB/s; no
  NVLink; PCIe Gen4 x16.
* B200 (HGX B200 datasheet, the 8-GPU board's figures / 8): FP32 75, TF32 1,125, BF16/FP16 2,250;
  180 GB HBM3e at 8 TB/s; NVLink 5 1.8 TB/s total via NVSwitch; PCIe Gen5. Its memory is the
  datasheet's, not an ``nvidia-smi`` reading (none was available to us).

Memory sizes are what ``nvidia-smi`` reports (MiB) where known: A100-40GB 40960, A100-80GB 81920,
H100 80GB 81559, H100 NVL 95830, H200 143771, L40S 46068. Detection prefers the reading NVML gives.

PCIe: Gen4 x16 moves 32 GB/s per direction raw and about 25 GB/s achieved; Gen5 x16 64 GB/s raw,
about 50 GB/s achieved (what ``cudaMemcpy`` bandwidth tests and nccl-tests over PCIe reach).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["GpuModel", "GPU_MODELS", "gpu_model", "PCIE_GEN4", "PCIE_GEN5", "conservative_model"]

MiB = 1024**2

PCIE_GEN4 = 25e9
"""Achievable bytes/s per direction over PCIe Gen4 x16."""
PCIE_GEN5 = 50e9
"""Achievable bytes/s per direction over PCIe Gen5 x16."""


@dataclass(frozen=True, kw_only=True)
class GpuModel:
    """One GPU model's datasheet figures and how its GPUs are wired inside a node."""

    key: str
    """Short name, e.g. ``h100-sxm``."""
    pattern: str
    """Regular expression matched (case-insensitively) against the device name."""
    example_name: str
    """A name the driver reports for it, e.g. ``NVIDIA H100 80GB HBM3``."""
    memory_bytes: int
    """Device memory, bytes (``nvidia-smi``'s total)."""
    peak_flops: dict[str, float] = field(default_factory=dict)
    """Dense peak FLOP/s: fp32, tf32, bf16, fp16."""
    hbm_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    fabric: str
    """How a node's GPUs talk: ``nvswitch`` (every GPU on NVLink through NVSwitch: SXM/HGX boards),
    ``bridge`` (PCIe cards; NVLink bridges join small groups when fitted) or ``pcie``."""
    nvlink_gen: int
    """NVLink generation (0: none)."""
    nvlink_bandwidth: float
    """NVLink bytes/s per GPU per direction (switch or bridge); 0 without NVLink."""
    bridge_group: int = 0
    """``bridge``: how many GPUs one bridge set joins (2: pairs, 4: the H200 NVL's 4-way bridge)."""
    host_bandwidth: float
    """Achievable bytes/s per direction between the GPU and host memory (its PCIe link)."""

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name, flags=re.IGNORECASE) is not None


_A100 = {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}
_H100 = {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}
_H100_PCIE = {"fp32": 51e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12}
_NVL = {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12}

GPU_MODELS: dict[str, GpuModel] = {m.key: m for m in [
    GpuModel(key="h100-nvl", pattern=r"(?<!G)H100.*NVL", example_name="NVIDIA H100 NVL", memory_bytes=95830 * MiB,
             peak_flops=_NVL, hbm_bandwidth=3.9e12, fabric="bridge", nvlink_gen=4, nvlink_bandwidth=300e9,
             bridge_group=2, host_bandwidth=PCIE_GEN5),
    GpuModel(key="h100-pcie", pattern=r"(?<!G)H100.*PCIE", example_name="NVIDIA H100 PCIe", memory_bytes=81559 * MiB,
             peak_flops=_H100_PCIE, hbm_bandwidth=2.0e12, fabric="bridge", nvlink_gen=4, nvlink_bandwidth=300e9,
             bridge_group=2, host_bandwidth=PCIE_GEN5),
    GpuModel(key="h100-sxm", pattern=r"(?<!G)H100", example_name="NVIDIA H100 80GB HBM3", memory_bytes=81559 * MiB,
             peak_flops=_H100, hbm_bandwidth=3.35e12, fabric="nvswitch", nvlink_gen=4, nvlink_bandwidth=450e9,
             host_bandwidth=PCIE_GEN5),
    GpuModel(key="h200-nvl", pattern=r"(?<!G)H200.*NVL", example_name="NVIDIA H200 NVL", memory_bytes=143771 * MiB,
             peak_flops=_NVL, hbm_bandwidth=4.8e12, fabric="bridge", nvlink_gen=4, nvlink_bandwidth=450e9,
             bridge_group=4, host_bandwidth=PCIE_GEN5),
    GpuModel(key="h200", pattern=r"(?<!G)H200", example_name="NVIDIA H200", memory_bytes=143771 * MiB,
             peak_flops=_H100, hbm_bandwidth=4.8e12, fabric="nvswitch", nvlink_gen=4, nvlink_bandwidth=450e9,
             host_bandwidth=PCIE_GEN5),
    GpuModel(key="a100-pcie-80gb", pattern=r"A100.*(80GB.*PCIE|PCIE.*80GB)", example_name="NVIDIA A100 80GB PCIe",
             memory_bytes=81920 * MiB, peak_flops=_A100, hbm_bandwidth=1935e9, fabric="bridge", nvlink_gen=3,
             nvlink_bandwidth=300e9, bridge_group=2, host_bandwidth=PCIE_GEN4),
    GpuModel(key="a100-pcie-40gb", pattern=r"A100.*PCIE", example_name="NVIDIA A100-PCIE-40GB",
             memory_bytes=40960 * MiB, peak_flops=_A100, hbm_bandwidth=1555e9, fabric="bridge", nvlink_gen=3,
             nvlink_bandwidth=300e9, bridge_group=2, host_bandwidth=PCIE_GEN4),
    GpuModel(key="a100-sxm-80gb", pattern=r"A100.*SXM.*80GB", example_name="NVIDIA A100-SXM4-80GB",
             memory_bytes=81920 * MiB, peak_flops=_A100, hbm_bandwidth=2039e9, fabric="nvswitch", nvlink_gen=3,
             nvlink_bandwidth=300e9, host_bandwidth=PCIE_GEN4),
    GpuModel(key="a100-sxm-40gb", pattern=r"A100.*SXM.*40GB", example_name="NVIDIA A100-SXM4-40GB",
             memory_bytes=40960 * MiB, peak_flops=_A100, hbm_bandwidth=1555e9, fabric="nvswitch", nvlink_gen=3,
             nvlink_bandwidth=300e9, host_bandwidth=PCIE_GEN4),
    GpuModel(key="l40s", pattern=r"L40S", example_name="NVIDIA L40S", memory_bytes=46068 * MiB,
             peak_flops={"fp32": 91.6e12, "tf32": 183e12, "bf16": 362.05e12, "fp16": 362.05e12},
             hbm_bandwidth=864e9, fabric="pcie", nvlink_gen=0, nvlink_bandwidth=0.0, host_bandwidth=PCIE_GEN4),
    GpuModel(key="b200", pattern=r"B200", example_name="NVIDIA B200", memory_bytes=180 * 10**9,
             peak_flops={"fp32": 75e12, "tf32": 1125e12, "bf16": 2250e12, "fp16": 2250e12},
             hbm_bandwidth=8e12, fabric="nvswitch", nvlink_gen=5, nvlink_bandwidth=900e9, host_bandwidth=PCIE_GEN5),
]}
"""Known models, most specific pattern first (matching stops at the first hit)."""


def gpu_model(name: str) -> GpuModel | None:
    """The table row whose pattern matches the device ``name``, or None for a model not in the table."""
    return next((m for m in GPU_MODELS.values() if m.matches(name)), None)


def conservative_model(name: str, memory_bytes: int | None) -> GpuModel:
    """A stand-in for an unknown GPU: the lowest figure of every known model per field (so a plan
    never counts on speed it may not have), PCIe Gen4 between GPUs, and ``memory_bytes`` when the
    driver reported it (else the smallest known memory)."""
    rows = list(GPU_MODELS.values())
    peaks = {k: min(m.peak_flops[k] for m in rows) for k in ("fp32", "tf32", "bf16", "fp16")}
    return GpuModel(key="unknown", pattern=re.escape(name), example_name=name,
                    memory_bytes=memory_bytes or min(m.memory_bytes for m in rows), peak_flops=peaks,
                    hbm_bandwidth=min(m.hbm_bandwidth for m in rows), fabric="pcie", nvlink_gen=0,
                    nvlink_bandwidth=0.0, host_bandwidth=PCIE_GEN4)
