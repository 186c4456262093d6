"""A rank's memory by category, measured by the runtime and set against the planner's prediction.

    pm.train_step(batch, measure_memory=True)     # a real step, that also records its peaks
    print(pm.memory_report())                     # predicted vs measured, per category

Categories (the planner's, ``fairscale.runtime.program.MEMORY_PARTS``):

* **parameters**: every storage the rank graphs hold as parameters (slices, replicas, ZeRO flat
  buffers and fp32 master shards, FSDP flat shards), each storage once;
* **gradients**: ``.grad`` of those tensors, each storage once;
* **optimizer**: per-element optimizer state (Adam's moments; ``step`` counters excluded);
* **activations**: the peak of the tensors autograd saved for backward during the measured step
  (each storage once, parameters and gathered FSDP buffers excluded), plus the inputs recompute
  regions keep by reference and what a region's recompute holds in backward until the region's
  backward reads it (the one layer a recompute rebuilds); measured only in a step run with
  ``measure_memory=True``. FSDP's gathered buffers are *buffers*: matmuls save views of them, but
  a unit frees the storage after its forward (``resize_(0)``, so those views hold nothing) and
  gathers it again for its backward;
* **buffers**: the peak of FSDP's gathered parameters, unsharded gradients in flight and ZeRO-2 /
  FSDP gradient accumulators during the last step (``passes.ops.gauge.UNSHARD``).

The first three are what the rank *holds* between steps (read them after a step: gradients and
optimizer state exist from the first one); the last two are peaks inside a step, as the planner
predicts them. Module buffers (running statistics, rotary tables) are listed apart: the planner does
not cost them. On CUDA the report adds the allocator's peak during the measured step
(``torch.cuda.max_memory_allocated``) against the predicted total.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from fairscale.runtime.optim import DataParallelOptimizer
from fairscale.runtime.program import MEMORY_PARTS
from passes.dp.info import find_dp_info
from passes.ops import recompute_ops
from passes.ops.gauge import UNSHARD

__all__ = ["MemoryReport", "measure_memory", "held_bytes", "ActivationMeter"]

StageState = tuple[torch.fx.GraphModule, DataParallelOptimizer]


def _key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (stable when FSDP frees and re-allocates a gathered buffer)."""
    return int(t.untyped_storage()._cdata)


def held_bytes(stages: Sequence[StageState]) -> dict[str, int]:
    """Bytes a rank's stages hold now: ``parameters``, ``gradients``, ``optimizer`` and ``module
    buffers``, each storage counted once."""
    seen: set[int] = set()

    def count(tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None or t.is_meta or _key(t) in seen:
                continue
            seen.add(_key(t))
            total += t.untyped_storage().nbytes()
        return total

    params: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    for gm, _ in stages:
        params += list(gm.parameters())
        info = find_dp_info(gm)
        if info is not None:
            params += [b.flat for b in info.buckets if b.flat is not None]
        buffers += list(gm.buffers())
    out = {"parameters": count(params)}
    grads: list[torch.Tensor | None] = [p.grad for p in params]
    out["gradients"] = count(grads)
    states = [v for _, opt in stages for st in opt.state.values() for v in st.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    out["optimizer"] = count(states)
    out["module buffers"] = count(buffers)
    return out


class _Saved:
    """A tensor autograd saved, counted in its meter for as long as autograd keeps it."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter) -> None:
        self.tensor, self.meter, self.key = tensor, meter, _key(tensor)
        meter._hold(self.key, tensor.untyped_storage().nbytes())

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Peak bytes of activations held for backward while it is entered (see the module docstring)."""

    def __init__(self, stages: Sequence[StageState]) -> None:
        self._exclude = {_key(p) for gm, _ in stages for p in gm.parameters()}
        for gm, _ in stages:
            info = find_dp_info(gm)
            if info is not None:
                self._exclude |= {_key(u.full) for u in info.units}
                self._exclude |= {_key(b.flat) for b in info.buckets if b.flat is not None}
        self._count: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self._retained: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = 0
        self.peak = 0
        self._hooks: Any = None

    def _hold(self, key: int, n: int) -> None:
        entry = self._count.setdefault(key, [0, n])
        entry[0] += 1
        if entry[0] == 1 and key not in self._retained:
            self.now += n
            self._update()

    def _release(self, key: int) -> None:
        entry = self._count.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._count[key]
            if key not in self._retained:
                self.now -= entry[1]

    def _update(self) -> None:
        for key, (ref, n) in list(self._retained.items()):
            if ref.expired():
                del self._retained[key]
                if key not in self._count:
                    self.now -= n
        self.peak = max(self.peak, self.now)

    def _keep(self, key: int, ref: StorageWeakRef, n: int) -> None:
        """Count a storage held by reference, which no saved-tensor hook sees, until it is freed."""
        if key in self._exclude:
            return
        if key not in self._retained and key not in self._count:
            self.now += n
        self._retained[key] = (ref, n)

    def _recomputed(self, held: list[tuple[StorageWeakRef, int]]) -> None:
        """Storages a region's recompute holds for the region's backward (checkpointing saves them
        through its own hooks, which ``_pack`` never sees); counted until they are freed."""
        for ref, n in held:
            self._keep(int(ref.cdata), ref, n)
        self._update()

    def _pack(self, t: torch.Tensor) -> Any:
        if t.is_meta or _key(t) in self._exclude:
            return t
        return _Saved(t, self)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _retain(self, args: tuple[Any, ...]) -> None:
        """Inputs a recompute region keeps by reference until its backward (no saved-tensor hook sees them)."""
        for a in args:
            if isinstance(a, torch.Tensor) and not a.is_meta:
                storage = a.untyped_storage()
                self._keep(_key(a), StorageWeakRef(storage), storage.nbytes())
        self._update()

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        recompute_ops.RETAIN_LISTENERS.append(self._retain)
        recompute_ops.RECOMPUTE_LISTENERS.append(self._recomputed)
        return self

    def __exit__(self, *exc: Any) -> None:
        recompute_ops.RECOMPUTE_LISTENERS.remove(self._recomputed)
        recompute_ops.RETAIN_LISTENERS.remove(self._retain)
        self._hooks.__exit__(*exc)
        self._update()


@dataclass(kw_only=True)
class MemoryReport:
    """Predicted and measured bytes per category for one rank (see the module docstring)."""

    predicted: dict[str, float]
    """Category -> bytes the planner predicts at this rank's peak (absent: not predicted)."""
    measured: dict[str, float | None]
    """Category -> bytes measured (None: not measured; run a step with ``measure_memory=True``)."""
    module_buffers: int = 0
    """Bytes of the rank graphs' module buffers (not costed by the planner)."""
    device_peak: int | None = None
    """CUDA only: ``torch.cuda.max_memory_allocated`` during the last measured step."""
    notes: list[str] = field(default_factory=list)

    def ratio(self, category: str) -> float | None:
        """measured / predicted, or None when either is missing or the prediction is 0."""
        m, p = self.measured.get(category), self.predicted.get(category)
        return None if m is None or not p else m / p

    @property
    def predicted_total(self) -> float:
        return sum(self.predicted.values())

    def table(self) -> str:
        """One line per category: predicted MiB, measured MiB and their ratio."""
        mib = 2**20

        def fmt(v: float | None) -> str:
            return "—" if v is None else f"{v / mib:10.3f}"

        rows = [f"{'':<16}{'predicted MiB':>14}{'measured MiB':>14}{'ratio':>8}"]
        for cat in MEMORY_PARTS:
            r = self.ratio(cat)
            rows.append(f"{cat:<16}{fmt(self.predicted.get(cat)):>14}{fmt(self.measured.get(cat)):>14}"
                        f"{'' if r is None else f'{r:.3f}':>8}")
        rows.append(f"{'module buffers':<16}{'—':>14}{fmt(self.module_buffers):>14}")
        if self.device_peak is not None:
            rows.append(f"{'CUDA peak':<16}{fmt(self.predicted_total):>14}{fmt(self.device_peak):>14}"
                        f"{self.device_peak / self.predicted_total if self.predicted_total else 0:>8.3f}")
        return "\n".join(rows + self.notes)

    def __str__(self) -> str:
        return self.table()


def measure_memory(stages: Sequence[StageState], *, predicted: dict[str, float], device: torch.device,
                   peaks: dict[str, float | None]) -> MemoryReport:
    """The report for a rank's ``stages`` now, with the step peaks recorded by the runtime (``peaks``:
    ``activations``, ``buffers``, ``device_peak``; None where not measured)."""
    held = held_bytes(stages)
    measured: dict[str, float | None] = {k: float(held[k]) for k in ("parameters", "gradients", "optimizer")}
    measured["activations"] = peaks.get("activations")
    measured["buffers"] = peaks.get("buffers")
    notes = []
    if measured["activations"] is None:
        notes.append("activations: not measured; run pm.train_step(batch, measure_memory=True) first")
    if not predicted:
        notes.append("predicted: none (the program was compiled without the planner's cost)")
    device_peak = peaks.get("device_peak") if device.type == "cuda" else None
    return MemoryReport(predicted=dict(predicted), measured=measured, module_buffers=held["module buffers"],
                        device_peak=None if device_peak is None else int(device_peak), notes=notes)


def step_peaks(device: torch.device) -> int:
    """Start a step's peak measurements (the buffer gauge's, and CUDA's allocator peak); returns
    the gauge's level now, which the step's peak is counted from (the gauge is process-wide: other
    modules' buffers may be held already)."""
    UNSHARD.reset_peak()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return UNSHARD.now
