"""The search space and the user's constraints on it.

Constraints are a partial plan: a dict in the plan's JSON shape holding only the fields the user
fixes, e.g. ``{"mesh": {"tp": 8}, "schedule": {"kind": "1f1b"}, "data_parallel": {"kind": "fsdp"}}``,
or a whole :class:`planner.plan.Plan` (everything fixed; this is how a hand-edited plan is
re-costed). The shorthand keys ``pp``, ``dp``, ``tp`` and ``microbatches`` may sit at the top.
``model``, ``cluster``, ``version`` and ``predicted`` describe a plan rather than constrain it and
are not read. Anything else is an error that lists what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.plan import BATCH_NORM_MODES, DP_KINDS, DTYPES, RECOMPUTE_KINDS, Plan, PlanError
from planner.schedule_kinds import KINDS

__all__ = ["Fixed", "parse_constraints", "divisors"]

_SECTIONS: dict[str, tuple[str, ...]] = {
    "mesh": ("pp", "dp", "tp", "ep"),
    "schedule": ("kind", "microbatches", "virtual_stages", "global_batch"),
    "tensor_parallel": ("rules", "sequence_parallel"),
    "data_parallel": ("kind", "units", "reshard_after_forward", "param_dtype", "reduce_dtype", "offload",
                      "prefetch", "bucket_mb"),
}
_WHOLE = ("stages", "recompute")
_SCALARS = ("batch_norm",)
_DESCRIPTIVE = ("model", "cluster", "version", "predicted")
_SHORT = {"pp": ("mesh", "pp"), "dp": ("mesh", "dp"), "tp": ("mesh", "tp"),
          "microbatches": ("schedule", "microbatches")}


@dataclass(kw_only=True)
class Fixed:
    """What the user fixed; None = the search chooses."""

    pp: int | None = None
    """Fixed pipeline degree."""
    dp: int | None = None
    """Fixed data-parallel degree."""
    tp: int | None = None
    """Fixed tensor-parallel degree."""
    ep: int | None = None
    """Fixed expert-parallel degree."""
    kind: str | None = None
    """Fixed schedule kind."""
    microbatches: int | None = None
    """Fixed microbatch count."""
    virtual_stages: int | None = None
    """Fixed chunks per pipeline rank."""
    stages: list[str] | None = None
    """Fixed stage selectors, in order."""
    tp_rules: dict[str, str] | None = None
    """Fixed tensor-parallel rules."""
    sequence_parallel: bool | None = None
    """Fixed sequence parallelism."""
    dp_kind: str | None = None
    """Fixed data-parallel kind."""
    units: str | None = None
    """Fixed FSDP unit selector."""
    reshard: bool | None = None
    """Fixed FSDP reshard_after_forward."""
    param_dtype: str | None = None
    """Fixed compute dtype."""
    reduce_dtype: str | None = None
    """Fixed gradient-reduction dtype."""
    prefetch: bool | None = None
    """Fixed FSDP prefetch."""
    bucket_mb: float | None = None
    """Fixed DDP/ZeRO bucket size."""
    recompute: dict[str, str] | None = None
    """Fixed recompute map (selector -> kind); {} fixes "recompute nothing"."""
    global_batch: int | None = None
    """The global batch a plan records (must equal the one searched for; 0 = not recorded)."""
    offload: bool | None = None
    """Fixed FSDP CPU offload of parameter shards, gradients and optimizer states."""
    batch_norm: str | None = None
    """Fixed batch-statistics mode (``"local"`` lets the search use microbatches with BatchNorm)."""


def parse_constraints(constraints: dict[str, Any] | Plan | None) -> Fixed:
    """Read constraints (see the module docstring); raise PlanError listing every problem."""
    if constraints is None:
        return Fixed()
    if isinstance(constraints, Plan):
        data = constraints.to_dict()
    elif isinstance(constraints, dict):
        data = dict(constraints)
    else:
        raise PlanError([f"constraints: expected a dict shaped like a plan (or a Plan), got "
                         f"{type(constraints).__name__}"], source="constraints")
    problems: list[str] = []
    nested: dict[str, dict[str, Any]] = {}
    for key, value in data.items():
        if key in _SHORT:
            sec, field = _SHORT[key]
            nested.setdefault(sec, {})[field] = value
        elif key in _SECTIONS:
            if not isinstance(value, dict):
                problems.append(f"{key}: expected an object, got {type(value).__name__}")
                continue
            for sub, val in value.items():
                if sub not in _SECTIONS[key]:
                    problems.append(f"{key}.{sub}: unknown field; {key} has {', '.join(_SECTIONS[key])}")
                else:
                    nested.setdefault(key, {})[sub] = val
        elif key in _WHOLE or key in _DESCRIPTIVE or key in _SCALARS:
            nested[key] = value
        else:
            allowed = sorted(list(_SECTIONS) + list(_WHOLE) + list(_SCALARS) + list(_SHORT))
            problems.append(f"{key}: unknown constraint; use one of {', '.join(allowed)}")
    out = Fixed()
    mesh = nested.get("mesh", {})
    for axis in ("pp", "dp", "tp", "ep"):
        if axis in mesh:
            out_val = _positive_int(f"mesh.{axis}", mesh[axis], problems)
            setattr(out, axis, out_val)
    sched = nested.get("schedule", {})
    if "kind" in sched:
        out.kind = _choice("schedule.kind", sched["kind"], tuple(KINDS), problems)
    if "microbatches" in sched:
        out.microbatches = _positive_int("schedule.microbatches", sched["microbatches"], problems)
    if sched.get("global_batch"):
        out.global_batch = _positive_int("schedule.global_batch", sched["global_batch"], problems)
    if "virtual_stages" in sched:
        out.virtual_stages = _positive_int("schedule.virtual_stages", sched["virtual_stages"], problems)
    if "stages" in nested and nested["stages"]:
        stages = nested["stages"]
        if not isinstance(stages, list):
            problems.append("stages: expected a list of {\"layers\": selector}")
        else:
            out.stages = [s["layers"] if isinstance(s, dict) else getattr(s, "layers", s) for s in stages]
    tpc = nested.get("tensor_parallel", {})
    if "rules" in tpc:
        out.tp_rules = dict(tpc["rules"])
    if "sequence_parallel" in tpc:
        out.sequence_parallel = bool(tpc["sequence_parallel"])
    dpc = nested.get("data_parallel", {})
    if "kind" in dpc:
        out.dp_kind = _choice("data_parallel.kind", dpc["kind"], DP_KINDS, problems)
    if "offload" in dpc:
        out.offload = bool(dpc["offload"])
        if out.offload and dpc.get("kind", "fsdp") != "fsdp":
            problems.append(f'data_parallel.offload: the cost model offloads FSDP shards only, but data_parallel.kind '
                            f'is "{dpc["kind"]}"; use "fsdp" or drop offload')
    for name, attr in (("param_dtype", "param_dtype"), ("reduce_dtype", "reduce_dtype")):
        if name in dpc:
            setattr(out, attr, _choice(f"data_parallel.{name}", dpc[name], DTYPES, problems))
    if "units" in dpc and dpc["units"]:
        out.units = str(dpc["units"])
    if "reshard_after_forward" in dpc:
        out.reshard = bool(dpc["reshard_after_forward"])
    if "prefetch" in dpc:
        out.prefetch = bool(dpc["prefetch"])
    if "bucket_mb" in dpc:
        out.bucket_mb = float(dpc["bucket_mb"])
    if "recompute" in nested:
        rec = nested["recompute"]
        if not isinstance(rec, dict):
            problems.append("recompute: expected an object of selector -> full/selective/none")
        else:
            for sel, kind in rec.items():
                if kind not in RECOMPUTE_KINDS:
                    problems.append(f'recompute["{sel}"]: "{kind}" is not one of {", ".join(RECOMPUTE_KINDS)}')
            out.recompute = dict(rec)
    if "batch_norm" in nested:
        out.batch_norm = _choice("batch_norm", nested["batch_norm"], BATCH_NORM_MODES, problems)
    if isinstance(constraints, Plan):
        _fill_plan_defaults(out, constraints)
    if problems:
        raise PlanError(problems, source="constraints")
    return out


def _fill_plan_defaults(out: Fixed, plan: Plan) -> None:
    """A whole Plan fixes every field, including the ones it leaves at their defaults."""
    out.stages = [s.layers for s in plan.stages] if plan.stages else None
    out.tp_rules = dict(plan.tensor_parallel.rules)
    out.recompute = dict(plan.recompute)
    dp = plan.data_parallel
    if dp.kind != "fsdp":
        out.reshard, out.prefetch = True, True


def _positive_int(path: str, value: Any, problems: list[str]) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.append(f"{path}: expected a positive integer, got {value!r}")
        return None
    return value


def _choice(path: str, value: Any, allowed: tuple[str, ...], problems: list[str]) -> str | None:
    if value not in allowed:
        problems.append(f"{path}: {value!r} is not one of {', '.join(allowed)}")
        return None
    return str(value)


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]

