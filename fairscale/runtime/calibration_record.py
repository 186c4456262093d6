"""What a CPU calibration measured, as stored in its JSON file: :class:`Calibration` (the fitted
planner Cluster and every raw rate beside it), the file format's :data:`CALIBRATION_VERSION`, and
:func:`machine_description` (where and when it was measured). Measuring is
:mod:`fairscale.runtime.calibrate`'s job; this module only holds and prints the record.

Usage::

    from fairscale.runtime.calibration_record import Calibration
    cal = Calibration.from_dict(json.loads(path.read_text()))
    print(cal.table())
"""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import dataclass, field
from typing import Any

import torch

from fairscale.runtime.calibrate_fit import FLAT_BANDWIDTH, spread
from planner.cluster import Cluster, host_memory_bytes

__all__ = ["CALIBRATION_VERSION", "Calibration", "machine_description"]

CALIBRATION_VERSION = 11
"""What a calibration file measured: 2 added the optimizer's cost per parameter tensor and timed
the op overhead on a transformer's ops; 3 measures CPU time × ranks per core instead of wall time
(load-independent), the host cost per collective call by group size and full recompute's host cost
per op; 4 plans with a transformer block's FLOP rate instead of the large GEMMs' and measures the
runtime's host work per step, per microbatch and per data-parallel tensor on real ``train_step``
calls; 5 measures that host work with all the calibration's ranks busy, as every other rate (4 ran
it on two ranks alone, without the contention of training), and the tensor-parallel op's cost with
it; 6 times a pipeline send as the runtime posts it (a batch of the send and its paired receive)
and gives it its own link, ``collective_links["p2p"]`` (a cache written before is measured again); 7
times a linear's forward and backward by weight shape, ``Cluster.gemm_flops`` (tensor-parallel ranks'
narrower GEMMs) and a layer norm's and an add's cost per byte, ``Cluster.whole_op_s`` (the ops a
tensor-parallel rank runs whole); 8 takes the transformer block's rate as the median of samples
spread over the whole calibration, ``block_flops_samples`` (one timing had followed the machine's
moment: 9.7-11.9 GFLOP/s over four calibrations), and times one matmul shape (1024×256×1024), not two; 9 fits the all-gather, reduce-scatter and
pipeline send per size range, ``Cluster.collective_ranges`` (one line through 4 KiB-16 MiB was
2.4× off for the reduce-scatter in between); 10 measures how long the machine's cores sit idle
in the runtime probe's steps, ``Cluster.core_idle`` (cores idle while time-sharing ranks wait:
wall time was 6-15% over the CPU work over the cores on every plan of the end-to-end grid,
unmodelled); 11 times each GEMM shape on two row counts, ``Cluster.gemm_flops``' rows (a tp-2
rank's attention linears on 256 rows had been charged the rate of 2048)."""

@dataclass(kw_only=True)
class Calibration:
    """Measured rates of one rank when ``ranks`` ranks run at once, and the Cluster fitted to them."""

    cluster: Cluster
    """The planner cluster to plan with (achieved rates, efficiencies 1)."""
    ranks: int
    """Ranks that ran concurrently."""
    matmul_flops: dict[str, float]
    """Shape ``MxKxN`` -> FLOP/s of the slowest rank."""
    memory_bandwidth: float
    """Bytes/s one rank streams while all do (``add``: 12 bytes per element)."""
    op_overhead_s: float = 0.0
    """Host seconds per tiny op (forward + 2× backward, per forward-op unit) while all ranks run."""
    optimizer_tensor_s: float = 0.0
    """Host seconds per parameter tensor of an Adam step while all ranks run."""
    recompute_op_s: float = 0.0
    """Host seconds per op of a fully recomputed block (``Cluster.recompute_op_s``)."""
    collective_call_s: dict[str, dict[int, float]] = field(default_factory=dict)
    """all_reduce / all_gather -> group size -> seconds per small call (``Cluster.collective_call_s``)."""
    block_flops: float = 0.0
    """FLOP/s of a transformer block's arithmetic with every rank at once (the cluster's peak)."""
    block_flops_samples: list[float] = field(default_factory=list)
    """The block's FLOP/s at each point of the calibration it was timed at, in order; ``block_flops``
    is their median (empty in files of version 7 and before: one timing)."""
    step_host_s: float = 0.0
    """The runtime's host seconds per step (``Cluster.step_host_s``)."""
    microbatch_host_s: float = 0.0
    """The runtime's host seconds per microbatch per stage chunk (``Cluster.microbatch_host_s``)."""
    dp_tensor_host_s: float = 0.0
    """Data parallelism's host seconds per parameter tensor per step (``Cluster.dp_tensor_host_s``)."""
    tp_op_host_s: float = 0.0
    """Host seconds per tensor-parallel collective op outside its wait (``Cluster.tp_op_host_s``)."""
    core_idle: float = 0.0
    """Seconds the cores sat idle in the runtime probe's steps per CPU second of the ranks (``Cluster.core_idle``)."""
    runtime_measured: bool = False
    """Whether the runtime host terms and ``core_idle`` were measured (else they are 0: not measured)."""
    collectives: dict[str, dict[int, float]]
    """all_reduce / all_gather / reduce_scatter / p2p -> message bytes -> median seconds."""
    fits: dict[str, dict[str, float]]
    """Per collective and ``combined``: ``latency_s`` and ``bandwidth`` (bytes/s) of the alpha-beta fit,
    and ``max_rel_error`` of the fit over the measured sizes."""
    machine: dict[str, Any] = field(default_factory=dict)
    """Where it was measured (:func:`machine_description`)."""

    def to_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster.to_dict(), "ranks": self.ranks, "matmul_flops": self.matmul_flops,
                "memory_bandwidth": self.memory_bandwidth, "op_overhead_s": self.op_overhead_s,
                "optimizer_tensor_s": self.optimizer_tensor_s, "version": CALIBRATION_VERSION,
                "recompute_op_s": self.recompute_op_s, "block_flops": self.block_flops,
                "block_flops_samples": self.block_flops_samples,
                "step_host_s": self.step_host_s, "microbatch_host_s": self.microbatch_host_s,
                "dp_tensor_host_s": self.dp_tensor_host_s, "runtime_measured": self.runtime_measured,
                "tp_op_host_s": self.tp_op_host_s, "core_idle": self.core_idle,
                "collective_call_s": {k: {str(g): t for g, t in v.items()} for k, v in self.collective_call_s.items()},
                "collectives": {k: {str(n): t for n, t in v.items()} for k, v in self.collectives.items()},
                "fits": self.fits, "machine": self.machine}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        return cls(cluster=Cluster.from_dict(data["cluster"]), ranks=int(data["ranks"]),
                   matmul_flops={k: float(v) for k, v in data["matmul_flops"].items()},
                   memory_bandwidth=float(data["memory_bandwidth"]),
                   op_overhead_s=float(data.get("op_overhead_s", 0.0)),
                   optimizer_tensor_s=float(data.get("optimizer_tensor_s", 0.0)),
                   recompute_op_s=float(data.get("recompute_op_s", 0.0)),
                   block_flops=float(data.get("block_flops", 0.0)),
                   block_flops_samples=[float(r) for r in data.get("block_flops_samples", [])],
                   step_host_s=float(data.get("step_host_s", 0.0)),
                   microbatch_host_s=float(data.get("microbatch_host_s", 0.0)),
                   dp_tensor_host_s=float(data.get("dp_tensor_host_s", 0.0)),
                   runtime_measured=bool(data.get("runtime_measured", False)),
                   tp_op_host_s=float(data.get("tp_op_host_s", 0.0)),
                   core_idle=float(data.get("core_idle", 0.0)),
                   collective_call_s={k: {int(g): float(t) for g, t in v.items()}
                                      for k, v in data.get("collective_call_s", {}).items()},
                   collectives={k: {int(n): float(t) for n, t in v.items()} for k, v in data["collectives"].items()},
                   fits=data["fits"], machine=data.get("machine", {}))

    def table(self) -> str:
        lines = [f"CPU calibration: {self.ranks} ranks on {self.machine.get('cpu', '?')} "
                 f"({self.machine.get('cores', '?')} cores)"]
        for shape, f in self.matmul_flops.items():
            lines.append(f"  matmul {shape:>16s}: {f / 1e9:8.2f} GFLOP/s per rank")
        for n_in, n_out, rate, rows in self.cluster.gemm_flops:
            lines.append(f"  linear {n_in:>5d}x{n_out:<5d}     : {rate / 1e9:8.2f} GFLOP/s per rank (forward+backward"
                         + (f", {rows} rows)" if rows else ")"))
        for kind, per_byte in self.cluster.whole_op_s.items():
            lines.append(f"  whole {kind:12s}    : {per_byte * 1e3 * 2**20:8.3f} ms per MiB of output (forward+backward)")
        lines.append(f"  transformer block     : {self.block_flops / 1e9:8.2f} GFLOP/s per rank (the planning rate"
                     + self._block_spread() + ")")
        lines.append(f"  memory bandwidth      : {self.memory_bandwidth / 1e9:8.2f} GB/s per rank")
        lines.append(f"  host overhead per op  : {self.op_overhead_s * 1e6:8.1f} us (forward; backward 2x)")
        lines.append(f"  Adam, per tensor      : {self.optimizer_tensor_s * 1e6:8.1f} us")
        lines.append(f"  recompute, per op     : {self.recompute_op_s * 1e6:8.1f} us (fully recomputed block)")
        lines.append(f"  runtime host          : {self.step_host_s * 1e3:8.2f} ms per step, "
                     f"{self.microbatch_host_s * 1e3:.2f} ms per microbatch per chunk, "
                     f"{self.dp_tensor_host_s * 1e6:.1f} us per data-parallel tensor, "
                     f"{self.tp_op_host_s * 1e6:.0f} us per tensor-parallel op; cores idle {self.core_idle * 100:.1f}% "
                     "of the ranks' CPU time in steps" if self.runtime_measured
                     else "  runtime host          : not measured (0; calibrate_cpu(runtime_host=...))")
        for op, calls in self.collective_call_s.items():
            lines.append(f"  {op} call, 1 KiB  : " + ", ".join(f"{g} ranks {t * 1e6:.0f} us" for g, t in sorted(calls.items())))
        for name, fit in self.fits.items():
            lines.append(f"  {name:22s}: alpha {fit['latency_s'] * 1e6:8.1f} us, beta {fit['bandwidth'] / 1e9:6.3f} GB/s"
                         f" (max fit error {fit['max_rel_error'] * 100:.0f}%)")
        for op, rows in self.cluster.collective_ranges.items():  # what plans use (per size range)
            lines.append(f"  {op + ' by size':22s}: " + "; ".join(
                f"to {end / 2**20:.3g} MiB alpha {lat * 1e6:.0f} us, "
                + ("latency only" if bw >= FLAT_BANDWIDTH else f"beta {bw / 1e9:.3g} GB/s") for end, bw, lat in rows))
        return "\n".join(lines)

    def _block_spread(self) -> str:
        """How steady the block's samples were, for the table (nothing for a file without them)."""
        if not self.block_flops_samples:
            return ""
        _, low, high = spread(self.block_flops_samples)
        return (f"; median of {len(self.block_flops_samples)} samples, middle half {low / 1e9:.2f}-{high / 1e9:.2f}, "
                f"all {min(self.block_flops_samples) / 1e9:.2f}-{max(self.block_flops_samples) / 1e9:.2f}")


def machine_description() -> dict[str, Any]:
    """CPU model, core count, memory, OS, torch version and the time of measurement."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": host_memory_bytes(), "os": platform.platform(),
            "torch": torch.__version__, "load_average_1m": load,
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
