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
      "batch_norm": "sync",
      "predicted": {"step_time_s": 0.0, "tflops_per_device": 0.0, "memory_gib": [0.0, 0.0],
                    "comm_gib_per_step": 0.0}
    }

Every dataclass here is keyword-only, and every field has a docstring. Reading a file checks its
shape (:meth:`Plan.from_json`: unknown keys, types, version, e.g.
``mesh.tp: expected an integer, got "2"``); ``planner.validate.validate_plan`` checks its meaning
for one model and device count. Both report every problem at once, each naming
its JSON path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.messages import closest, describe, json_path_key
from planner.tp_styles import TP_STYLES  # noqa: F401 - the one table of tensor-parallel styles, re-exported

PLAN_VERSION = 1
READABLE_VERSIONS = (PLAN_VERSION,)
"""Plan file versions this build can read."""

DP_KINDS = ("ddp", "zero1", "zero2", "fsdp")
RECOMPUTE_KINDS = ("full", "selective", "none")
DTYPES = ("fp32", "bf16", "fp16")
BATCH_NORM_MODES = ("sync", "local")
KEEP_BATCH_WHOLE = "mesh.dp 1 and schedule.microbatches 1"
"""The plan fields that keep the batch whole (each step runs the model once on the whole global
batch, as tensor parallelism and a pipeline of one microbatch do): the remedy wherever cutting the
batch would change the numbers. :func:`whole_batch` applies it to search constraints."""
"""``Plan.batch_norm``: how training-mode batch statistics are taken when the batch is split."""


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
    """A name in ``planner.schedule_kinds.KINDS``: gpipe, 1f1b, interleaved, v (V-shaped: two chunks per
    rank, down and back up)."""
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
    """Model FLOPs per step / step time / devices, in TFLOP/s (recompute not counted)."""
    hardware_tflops_per_device: float = 0.0
    """FLOPs the devices execute per step (recomputed forwards included) / step time / devices, TFLOP/s."""
    mfu: float = 0.0
    """Model FLOPs utilization: ``tflops_per_device`` over the device's peak in the compute dtype."""
    hfu: float = 0.0
    """Hardware FLOPs utilization: ``hardware_tflops_per_device`` over the same peak."""
    memory_gib: list[float] = field(default_factory=list)
    """Peak memory per pipeline stage, GiB."""
    comm_gib_per_step: float = 0.0
    """Bytes sent per device per step over all collectives, GiB."""
    bubble: float = 0.0
    """Pipeline bubble as a fraction of step time."""
    devices_used: int = 0
    """Devices the mesh uses (fewer than the cluster's when that is faster; 0 = not recorded)."""
    notes: list[str] = field(default_factory=list)
    """What a reader of the prediction should know: the precision, idle devices and why, a
    pipeline with fewer microbatches than stages and why."""


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
    batch_norm: str = "sync"
    """Batch statistics (training-mode BatchNorm, InstanceNorm running statistics) when dp ranks
    and microbatches split the batch. ``sync`` (exact): over the dp group's global batch, as one
    process computes them (SyncBatchNorm); a plan with more than one microbatch is refused, since
    no pipeline can give each microbatch the whole batch's statistics. ``local`` (opt-in): each dp
    rank and microbatch uses its own statistics and updates the running statistics once per
    microbatch, as torch DDP without SyncBatchNorm does; losses and running statistics then differ
    from one process's."""
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
    def from_dict(cls, data: dict[str, Any], *, source: str = "plan") -> Plan:
        """Build a plan from parsed JSON; raise PlanError listing every schema problem (keys, types, version)."""
        return plan_from_dict(data, source=source)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<string>") -> Plan:
        """Parse plan JSON text. ``source`` (a file name) prefixes syntax errors as ``file:line:col``."""
        return plan_from_json(text, source=source)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan file (its shape only; ``planner.validate.validate_plan`` checks it against a model)."""
        path = Path(path)
        return cls.from_json(path.read_text(encoding="utf-8-sig"), source=str(path))

    @classmethod
    def read(cls, path: str | Path) -> tuple[Plan, list[str]]:
        """Read a plan file leniently: the plan and its schema problems (see :func:`read_plan_json`);
        hand both to ``validate_plan(..., schema_problems=...)`` to report every problem at once."""
        path = Path(path)
        return read_plan_json(path.read_text(encoding="utf-8-sig"), source=str(path))


def whole_batch(constraints: dict[str, Any] | Plan | None) -> dict[str, Any]:
    """``constraints`` (a plan-shaped dict or a Plan) with :data:`KEEP_BATCH_WHOLE` added."""
    whole = constraints.to_dict() if isinstance(constraints, Plan) else dict(constraints or {})
    whole["mesh"] = {**whole.get("mesh", {}), "dp": 1}
    whole["schedule"] = {**whole.get("schedule", {}), "microbatches": 1}
    return whole


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


# --- reading JSON: the schema half of plan checking (keys, types, version) -----------------------

class _Obj(dict[str, Any]):
    """A JSON object that remembers keys the file repeated (json keeps only the last)."""

    duplicates: list[str]


def _pairs(pairs: list[tuple[str, Any]]) -> _Obj:
    obj = _Obj()
    obj.duplicates = []
    for key, value in pairs:
        if key in obj and key not in obj.duplicates:
            obj.duplicates.append(key)
        obj[key] = value
    return obj


def plan_from_json(text: str, *, source: str = "<string>") -> Plan:
    """Parse plan JSON text. ``source`` (a file name) prefixes syntax errors as ``file:line:col``."""
    plan, problems = read_plan_json(text, source=source)
    if problems:
        raise PlanError(problems, source=source)
    return plan


def read_plan_json(text: str, *, source: str = "<string>") -> tuple[Plan, list[str]]:
    """Leniently parse plan JSON text: the plan with every field that could be read (the others
    keep their defaults) and the schema problems, so that validation can go on and report every
    problem at once. Raises PlanError only for what leaves nothing to check: a syntax error, a
    top level that is not an object, or a version this build cannot read."""
    try:
        data = json.loads(text, object_pairs_hook=_pairs)
    except json.JSONDecodeError as exc:
        lines = text.splitlines() or [""]
        line = lines[exc.lineno - 1] if exc.lineno - 1 < len(lines) else ""
        caret = " " * (exc.colno - 1) + "^"
        raise PlanError([f"{source}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}\n"
                         f"      {line}\n      {caret}"], source=source) from None
    return read_plan_dict(data, source=source)


def plan_from_dict(data: Any, *, source: str = "plan") -> Plan:
    """Build a :class:`Plan` from parsed JSON; raise PlanError listing every schema problem."""
    plan, problems = read_plan_dict(data, source=source)
    if problems:
        raise PlanError(problems, source=source)
    return plan


def read_plan_dict(data: Any, *, source: str = "plan") -> tuple[Plan, list[str]]:
    """:func:`read_plan_json` for parsed JSON."""
    problems: list[str] = []
    if not isinstance(data, dict):
        raise PlanError([f"(top level): expected an object, got {describe(data)}"], source=source)
    version = data.get("version", _MISSING)
    readable = ", ".join(str(v) for v in READABLE_VERSIONS)
    if version is _MISSING:
        problems.append(f'version: missing; this build reads plan version {readable} (add "version": {PLAN_VERSION})')
    elif not _is_int(version):
        problems.append(f"version: expected an integer, got {describe(version)}")
        data = {k: v for k, v in data.items() if k != "version"}  # reported once is enough
    elif version not in READABLE_VERSIONS:
        # Nothing else in a file of another version can be judged by this version's schema.
        raise PlanError([f"version: plan version {version} cannot be read; this build reads version {readable}"],
                        source=source)
    plan = _read_dataclass(Plan, data, "", problems)
    assert isinstance(plan, Plan)
    return plan, problems


_MISSING = object()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_name(f: dataclasses.Field[Any]) -> str:
    return "class" if f.name == "class_" else f.name


def _read_dataclass(cls: type, data: Any, path: str, problems: list[str]) -> Any:
    if not isinstance(data, dict):
        problems.append(f"{path or '(top level)'}: expected an object, got {describe(data)}")
        return None
    fields = {_json_name(f): f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in getattr(data, "duplicates", []):
        problems.append(f"{json_path_key(path, key)}: key appears more than once; JSON keeps only the "
                        "last one, so remove the others")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            problems.append(_unknown_key(path, key, list(fields)))
            continue
        f = fields[key]
        got = _read_value(hints[f.name], value, json_path_key(path, key), problems)
        if got is not _MISSING:
            kwargs[f.name] = got
    return cls(**kwargs)


def _unknown_key(path: str, key: str, allowed: list[str]) -> str:
    close = closest(key, allowed)
    hint = f'did you mean "{close}"? ' if close else ""
    return f"{json_path_key(path, key)}: unknown key; {hint}(allowed: {', '.join(allowed)})"


def _read_value(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    """Check ``value`` against the field type ``tp``; append a problem and return _MISSING if wrong."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        got = _read_dataclass(tp, value, path, problems)  # type: ignore[arg-type]
        return _MISSING if got is None else got
    if tp is bool:
        if isinstance(value, bool):
            return value
        return _wrong(path, "true or false", value, problems)
    if tp is int:
        if _is_int(value):
            return value
        return _wrong(path, "an integer", value, problems)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)  # 25 and 25.0 are the same number; keep the field's type exact
        return _wrong(path, "a number", value, problems)
    if tp is str:
        if isinstance(value, str):
            return value
        return _wrong(path, "a string", value, problems)
    if tp is Any:
        return _plain(value)
    if origin is list:
        if not isinstance(value, list):
            return _wrong(path, "an array", value, problems)
        (item_tp,) = typing.get_args(tp)
        n = len(problems)
        items = [_read_value(item_tp, v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return _MISSING if len(problems) > n else items
    if origin is dict:
        if not isinstance(value, dict):
            return _wrong(path, "an object", value, problems)
        _, value_tp = typing.get_args(tp)
        n = len(problems)
        for key in getattr(value, "duplicates", []):
            problems.append(f"{json_path_key(path, key)}: key appears more than once; JSON keeps only "
                            "the last one, so remove the others")
        out = {k: _read_value(value_tp, v, json_path_key(path, k), problems) for k, v in value.items()}
        return _MISSING if len(problems) > n else out
    raise TypeError(f"plan_io cannot read fields of type {tp!r} ({path}); teach _read_value about it")


def _wrong(path: str, expected: str, value: Any, problems: list[str]) -> Any:
    problems.append(f"{path}: expected {expected}, got {describe(value)}")
    return _MISSING


def _plain(value: Any) -> Any:
    """Parsed JSON with the duplicate-tracking objects turned back into plain dicts."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
