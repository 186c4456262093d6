"""Measure this machine's GPU for the cost model, once, and plan detected GPUs with what it gets.

Usage::

    from fairscale.runtime.calibrate_gpu import gpu_cluster, calibrate_gpu_and_cache
    cluster = gpu_cluster(Cluster.detect())     # the cached calibration applied (measured on first use)
    calibrate_gpu_and_cache(out=sys.stdout)     # what ``fairscale calibrate`` runs on a GPU machine

A detected GPU is otherwise planned with its datasheet peaks times the fixed fractions of
``planner.cluster.Efficiency`` (0.70 of the matmul peak, 0.7 of HBM). Calibration replaces both with
what this GPU achieves, measured in a child process (a CUDA context in the planning process would
break the ranks that ``fairscale.launch`` forks from it), in a few seconds (2.3 s on an H200):

* **GEMM FLOP/s per dtype** (bf16, fp16, tf32, fp32): a linear's forward, input-gradient and
  weight-gradient GEMMs of a transformer's MLP shape (8192 tokens, width h, 4h features), for
  h = 1024 .. 8192 in bf16 and at h = 4096 in the others. The rate at :data:`PLANNING_WIDTH` becomes
  the cluster's ``peak_flops`` with ``Efficiency.matmul = 1`` (these are achieved rates); the table
  shows every width, since narrow models reach less of it (the cost model charges one rate).
* **memory bandwidth**: ``torch.add`` over three 512 MiB bf16 arrays (two reads and a write per
  element) becomes ``hbm_bandwidth`` with ``Efficiency.memory = 1``.
* **kernel launch**: host seconds per small kernel launched back to back; reported only: the cost
  model charges GPUs no per-op host time (their kernels queue ahead of the host), and a step whose
  kernels are shorter than this is launch-bound, which the table says.

Not measured: collectives and point-to-point between GPUs (NCCL needs one process per GPU); they
keep the datasheet link times ``Efficiency.network``, as the table says. The cache lives beside the
CPU calibrations (``FAIRSCALE_CACHE_DIR``), keyed by GPU model, count, driver-facing versions
(torch, CUDA); ``FAIRSCALE_NO_CALIBRATE=1`` never measures, and launched ranks only read the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from fairscale.runtime.calibration_cache import cache_root, write_whole
from planner.cluster import Cluster, Efficiency

__all__ = ["GpuCalibration", "measure", "gpu_cluster", "calibrate_gpu_and_cache", "gpu_cache_path",
           "GPU_CALIBRATION_VERSION", "PLANNING_WIDTH"]

GPU_CALIBRATION_VERSION = 1
PLANNING_WIDTH = 4096
"""The width whose GEMM rate plans use: where Megatron-LM's and Llama's mid-size models sit."""
WIDTHS = (1024, 2048, 4096, 8192)
TOKENS = 8192
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}
_RUN_S = 0.15
"""Seconds each timed measurement runs (after one warm-up run): well past launch noise."""


@dataclass(frozen=True)
class GpuCalibration:
    """What one GPU of this machine achieved (:func:`measure`)."""

    device: str
    gpus: int
    versions: dict[str, str]
    gemm_flops: dict[str, dict[int, float]]
    """dtype -> width -> FLOP/s of the MLP-shaped linear's three GEMMs."""
    memory_bandwidth: float
    launch_s: float
    seconds: float
    version: int = GPU_CALIBRATION_VERSION

    def peak_flops(self) -> dict[str, float]:
        """The planning rate per dtype: its rate at :data:`PLANNING_WIDTH` (else its widest)."""
        return {d: rates.get(PLANNING_WIDTH, rates[max(rates)]) for d, rates in self.gemm_flops.items()}

    def apply(self, cluster: Cluster) -> Cluster:
        """``cluster`` (detected GPUs of this model) planned with the measured rates."""
        peaks = {**cluster.peak_flops, **self.peak_flops()}
        return dataclasses.replace(
            cluster, name="detected-calibrated", peak_flops=peaks, hbm_bandwidth=self.memory_bandwidth,
            efficiency=Efficiency(matmul=1.0, memory=1.0, network=cluster.efficiency.network))

    def table(self, datasheet: Cluster | None = None) -> str:
        lines = [f"GPU calibration of {self.device} ({self.gpus} visible; torch {self.versions.get('torch')}, "
                 f"CUDA {self.versions.get('cuda')}), measured in {self.seconds:.1f} s:"]
        for dtype, rates in self.gemm_flops.items():
            peak = datasheet.peak_flops.get(dtype) if datasheet else None
            cells = ", ".join(f"h={w}: {r / 1e12:.0f}" + (f" ({r / peak:.0%})" if peak else "")
                              for w, r in sorted(rates.items()))
            lines.append(f"  {dtype:>4} GEMM TFLOP/s (of datasheet peak): {cells}")
        bw = f" ({self.memory_bandwidth / datasheet.hbm_bandwidth:.0%} of datasheet)" if datasheet else ""
        lines.append(f"  memory bandwidth {self.memory_bandwidth / 1e12:.2f} TB/s{bw}")
        lines.append(f"  kernel launch {self.launch_s * 1e6:.1f} us of host time each (not charged: a step whose "
                     "kernels are shorter than this is launch-bound, which the cost model does not see)")
        lines.append(f"  planning with the h={PLANNING_WIDTH} rates and the measured bandwidth (efficiency 1); "
                     "collectives between GPUs are not measured (datasheet link x efficiency.network)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["gemm_flops"] = {d: {str(w): r for w, r in rates.items()} for d, rates in self.gemm_flops.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GpuCalibration:
        fields = {**data, "gemm_flops": {d: {int(w): float(r) for w, r in rates.items()}
                                         for d, rates in data["gemm_flops"].items()}}
        return cls(**fields)


def _timed(fn: Callable[[], None], sync: Callable[[], None]) -> float:
    """Seconds per ``fn()``: one warm-up, then back-to-back calls for about :data:`_RUN_S`."""
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - start, 1e-6)
    calls = max(1, int(_RUN_S / one))
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls


def _gemm_rate(device: torch.device, dtype: torch.dtype, width: int, tokens: int,
               sync: Callable[[], None]) -> float:
    x = torch.randn(tokens, width, device=device, dtype=dtype)
    w = torch.randn(4 * width, width, device=device, dtype=dtype)
    dy = torch.randn(tokens, 4 * width, device=device, dtype=dtype)

    def step() -> None:
        torch.mm(x, w.t())      # forward
        torch.mm(dy, w)         # input gradient
        torch.mm(dy.t(), x)     # weight gradient

    return 3 * 2 * tokens * width * 4 * width / _timed(step, sync)


def _bandwidth(device: torch.device, elements: int, sync: Callable[[], None]) -> float:
    """Bytes per second of ``torch.add`` over bf16 arrays (two reads and a write per element)."""
    a, b = (torch.ones(elements, device=device, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    return 3 * a.numel() * a.element_size() / _timed(lambda: torch.add(a, b, out=c), sync)


def measure(device: torch.device | str = "cuda", *, widths: tuple[int, ...] = WIDTHS, tokens: int = TOKENS,
            elements: int = 2**28) -> GpuCalibration:
    """Measure ``device`` in this process (it creates a CUDA context: call it in a child, as
    :func:`calibrate_gpu_and_cache` does). ``widths``, ``tokens`` and ``elements`` size the work
    (tests run it small on the CPU)."""
    started = time.perf_counter()
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = matmul.fp32_precision, conv.fp32_precision
    rates: dict[str, dict[int, float]] = {}
    try:
        for name, dtype in DTYPES.items():
            matmul.fp32_precision = conv.fp32_precision = "tf32" if name == "tf32" else "ieee"
            shown = widths if name == "bf16" else tuple(w for w in widths if w == PLANNING_WIDTH) or widths[-1:]
            rates[name] = {w: _gemm_rate(dev, dtype, w, tokens, sync) for w in shown}
    finally:
        matmul.fp32_precision, conv.fp32_precision = saved
    bandwidth = _bandwidth(dev, elements, sync)
    tiny = torch.zeros(16, device=dev)

    def launches() -> None:
        for _ in range(200):
            tiny.add_(1.0)

    launch_s = _timed(launches, sync) / 200
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    gpus = torch.cuda.device_count() if dev.type == "cuda" else 0
    versions = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    return GpuCalibration(device=name, gpus=gpus, versions=versions, gemm_flops=rates, memory_bandwidth=bandwidth,
                          launch_s=launch_s, seconds=time.perf_counter() - started)


def gpu_cache_path(device: str) -> Path:
    """Where the calibration of this machine's GPUs named ``device`` (the driver's name) is cached:
    keyed by that name, the visible GPU count (NVML's, the same in the planning process and in
    launched ranks, whatever node shape they detect) and the torch and CUDA versions."""
    key = json.dumps({"device": device, "gpus": torch.cuda.device_count(), "torch": torch.__version__,
                      "cuda": str(torch.version.cuda)}, sort_keys=True)
    return cache_root() / "calibration" / f"gpu-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read(path: Path) -> GpuCalibration | None:
    try:
        data = json.loads(path.read_text())
        return GpuCalibration.from_dict(data) if data.get("version") == GPU_CALIBRATION_VERSION else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def calibrate_gpu_and_cache(cluster: Cluster | None = None, *, out: object = None) -> GpuCalibration:
    """Measure GPU 0 in a child process (:func:`measure`) and replace the cached calibration."""
    stream = out if out is not None else sys.stderr
    detected = cluster or Cluster.detect()
    path = gpu_cache_path(detected.device)
    print(f"calibrating {detected.device} (a few seconds; cached in {path}) ...", file=stream,  # type: ignore[arg-type]
          flush=True)
    done = subprocess.run([sys.executable, "-m", "fairscale.runtime.calibrate_gpu"], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"GPU calibration failed in its child process (exit {done.returncode}):\n"
                           f"{done.stderr.strip()[-2000:]}\n"
                           "set FAIRSCALE_NO_CALIBRATE=1 to plan with datasheet figures")
    cal = GpuCalibration.from_dict(json.loads(done.stdout.strip().splitlines()[-1]))
    write_whole(path, lambda tmp: tmp.write_text(json.dumps(cal.to_dict(), indent=1)))
    print(cal.table(detected), file=stream, flush=True)  # type: ignore[arg-type]
    return cal


def gpu_cluster(detected: Cluster) -> Cluster:
    """``detected`` planned with this machine's GPU calibration: the cached one, else measured now
    (first use, outside launched ranks, unless ``FAIRSCALE_NO_CALIBRATE``), else ``detected``."""
    found = _read(gpu_cache_path(detected.device))
    if found is None and not os.environ.get("FAIRSCALE_NO_CALIBRATE") and not dist.is_initialized():
        found = calibrate_gpu_and_cache(detected)
    return found.apply(detected) if found is not None else detected


if __name__ == "__main__":  # the child process of calibrate_gpu_and_cache
    print(json.dumps(measure("cuda").to_dict()))
