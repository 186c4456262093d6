"""The plan: a small, versioned, hand-editable description of how to parallelize one model.

A plan names modules by path, with globs and ranges (see ``planner.selectors``)::

    {
      "version": 1,
      "model": {"class": "LlamaForCausalLM", "fingerprint": "3f2a…", "parameters": 6738415616,
                "factory": "mypkg.models:build_llama"},
      "cluster": {"preset": "h100-sxm", "nodes": 1},
      "mesh": {"pp": 2, "dp": 2, "tp": 2},
      "schedule": {"kind": "1f1b", "microbatches": 8, "virtual_stages": 1, "global_batch": 64},
      "stages": [{"layers": "embed_tokens, layers.[0-15]"}, {"layers": "layers.[16-31], norm, lm_head"}],
      "tensor_parallel": {"rules": {"layers.*.self_attn.[q_proj,k_proj,v_proj]": "colwise",
                                    "layers.*.self_attn.o_proj": "rowwise"},
                          "sequence_parallel": false},
      "data_parallel": {"kind": "fsdp", "units": "layers.*", "reshard_after_forward": true,
                        "param_dtype": "fp32", "reduce_dtype": "fp32", "offload": false,
                        "prefetch": true, "bucket_mb": 25},
      "recompute": {"layers.[0-7]": "full"},
      "predicted": {"step_time_s": 0.0, "tflops_per_device": 0.0, "memory_gib": [0.0, 0.0],
                    "comm_gib_per_step": 0.0}
    }

Every dataclass here is keyword-only, and every field has a docstring. Reading a file checks its
shape (``planner.plan_io``: unknown keys, types, version); ``Plan.validate`` checks its meaning for
one model and device count (``planner.validate``). Both report every problem at once, each naming
its JSON path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.tp_styles import TP_STYLES  # the one table of tensor-parallel styles, re-exported

PLAN_VERSION = 1

SCHEDULES = ("gpipe", "1f1b", "interleaved", "v")
DP_KINDS = ("ddp", "zero1", "zero2", "fsdp")
RECOMPUTE_KINDS = ("full", "selective", "none")
DTYPES = ("fp32", "bf16", "fp16")


@dataclass(kw_only=True)
class ModelRef:
    """Which model the plan was made for."""

    class_: str = ""
    """Class name of the model (JSON key ``class``)."""
    fingerprint: str = ""
    """Hash of parameter names and shapes; a plan for another model is refused."""
    parameters: int = 0
    """Number of parameters, for the reader."""
    factory: str = ""
    """Importable factory (``pkg.module:function``) the plan was made from, if known; lets
    ``fairscale validate plan.json`` and ``fairscale report plan.json`` rebuild the model."""


@dataclass(kw_only=True)
class Mesh:
    """Device mesh shape; pp × dp × tp must equal the number of devices."""

    pp: int = 1
    """Pipeline-parallel degree (number of stages, or stage groups when interleaved)."""
    dp: int = 1
    """Data-parallel degree."""
    tp: int = 1
    """Tensor-parallel degree (kept inside a node)."""
    ep: int = 1
    """Expert-parallel degree: MoE experts are split over groups of ``ep`` consecutive dp ranks and
    tokens reach them by all-to-all. Must divide dp and every MoE layer's expert count; it adds no
    devices (pp × dp × tp is still the device count)."""

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.tp


@dataclass(kw_only=True)
class Schedule:
    """Pipeline schedule."""

    kind: str = "1f1b"
    """One of gpipe, 1f1b, interleaved, v (V-shaped: two chunks per rank, down and back up)."""
    microbatches: int = 1
    """Microbatches per step; the global batch must divide by dp × microbatches."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved: 2 or more; v: 2; 1 otherwise)."""
    global_batch: int = 0
    """Samples per optimizer step the plan was made for (0: not recorded). It must split into
    dp × microbatches equal microbatches; re-costing a loaded plan uses it."""


@dataclass(kw_only=True)
class Stage:
    """One pipeline stage (or virtual stage): a contiguous run of layers."""

    layers: str = ""
    """Selector of the stage's layers, e.g. ``embed_tokens, layers.[0-15]``."""


@dataclass(kw_only=True)
class TensorParallel:
    """Tensor-parallel rules, applied on the tp axis."""

    rules: dict[str, str] = field(default_factory=dict)
    """Module selector -> style (colwise, colwise_gather, rowwise, vocab_embedding, vocab_loss, expert, replicate)."""
    sequence_parallel: bool = False
    """Shard norm and dropout regions along the sequence (Korthikanti et al. 2022)."""


@dataclass(kw_only=True)
class DataParallel:
    """Data parallelism on the dp axis."""

    kind: str = "ddp"
    """One of ddp, zero1, zero2, fsdp."""
    units: str = ""
    """FSDP only: selector of the modules that form units (each match is one unit; the rest is the root unit)."""
    reshard_after_forward: bool = True
    """FSDP only: free gathered parameters after forward and gather again in backward."""
    param_dtype: str = "fp32"
    """Dtype parameters are computed in (fp32 master weights are kept)."""
    reduce_dtype: str = "fp32"
    """Dtype gradients are reduced in."""
    offload: bool = False
    """Keep parameter shards, gradients and optimizer states on the CPU."""
    prefetch: bool = True
    """FSDP only: start gathering the next unit while the current one computes."""
    bucket_mb: float = 25.0
    """DDP/ZeRO: gradient bucket size in MiB."""


@dataclass(kw_only=True)
class Predicted:
    """What the cost model predicts for this plan; filled by the planner, re-filled on load."""

    step_time_s: float = 0.0
    """Predicted time of one optimizer step, seconds."""
    tflops_per_device: float = 0.0
    """Model FLOPs per step / step time / devices, in TFLOP/s."""
    memory_gib: list[float] = field(default_factory=list)
    """Peak memory per pipeline stage, GiB."""
    comm_gib_per_step: float = 0.0
    """Bytes sent per device per step over all collectives, GiB."""
    bubble: float = 0.0
    """Pipeline bubble as a fraction of step time."""


@dataclass(kw_only=True)
class Plan:
    """How to parallelize one model on one cluster. Round-trips exactly through JSON."""

    version: int = PLAN_VERSION
    """Schema version; this build reads version 1."""
    model: ModelRef = field(default_factory=ModelRef)
    """The model the plan was made for."""
    cluster: dict[str, Any] = field(default_factory=dict)
    """The cluster the plan was made for (``Cluster.to_dict()``)."""
    mesh: Mesh = field(default_factory=Mesh)
    """pp × dp × tp."""
    schedule: Schedule = field(default_factory=Schedule)
    """Pipeline schedule and microbatches."""
    stages: list[Stage] = field(default_factory=list)
    """Stages in order (pp × virtual_stages of them); empty means one stage holding every layer."""
    tensor_parallel: TensorParallel = field(default_factory=TensorParallel)
    """Tensor-parallel rules."""
    data_parallel: DataParallel = field(default_factory=DataParallel)
    """Data-parallel kind and options."""
    recompute: dict[str, str] = field(default_factory=dict)
    """Layer selector -> full, selective or none."""
    predicted: Predicted = field(default_factory=Predicted)
    """Cost-model prediction (informational; recomputed when a plan is loaded)."""

    # --- serialization -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _to_jsonable(self)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write the plan as JSON. Refuses to replace an existing file unless ``overwrite=True``."""
        path = Path(path)
        refused = FileExistsError(f"{path} exists; pass overwrite=True (CLI: --force) to replace it")
        if path.exists() and not overwrite:
            raise refused
        # Write a temporary file next to the target, then move it in, so a crash never leaves half
        # a plan. Without overwrite, a hard link is the move: it fails if the file appeared meanwhile.
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.to_json())
            if overwrite:
                tmp.replace(path)
            else:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise refused from None
                except OSError:  # a filesystem without hard links: fall back to check-then-move
                    if path.exists():
                        raise refused from None
                    tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        from planner.plan_io import plan_from_dict

        return plan_from_dict(data)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<string>") -> Plan:
        from planner.plan_io import plan_from_json

        return plan_from_json(text, source=source)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        return cls.from_json(path.read_text(encoding="utf-8-sig"), source=str(path))

    def validate(self, graph: Any, cluster: Any = None, *, devices: int | None = None) -> None:
        """Check the plan against a captured model and cluster; raise PlanError listing every problem."""
        from planner.validate import validate_plan

        validate_plan(self, graph, cluster, devices=devices)


def _to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            key = "class" if f.name == "class_" else f.name
            out[key] = _to_jsonable(getattr(obj, f.name))
        return out
    if isinstance(obj, dict):
        return {k: _to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_jsonable(v) for v in obj]
    return obj


class PlanError(ValueError):
    """A plan that cannot be used. ``problems`` lists every problem, each naming its JSON path."""

    def __init__(self, problems: list[str], *, source: str = "plan") -> None:
        self.problems = list(problems)
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        n = len(self.problems)
        super().__init__(f"{source} has {n} problem{'' if n == 1 else 's'}:\n{lines}")
