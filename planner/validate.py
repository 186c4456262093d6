"""Check a plan against a captured model and a device count; report every problem at once.

``Plan.from_json`` checks the file's shape (keys, types, version); this module checks what the
values mean. Each problem names its JSON path, what was found and what is allowed, and shows the
arithmetic where there is some::

    mesh: pp(2) × dp(3) × tp(2) = 12, but 8 devices were given; choose degrees whose product is 8 (e.g. dp 2)
    stages[1].layers: "layerz.[0-3]" matches no layer; did you mean "layers.[0-3]"?

Usage::

    validate_plan(plan, graph, cluster, devices=8)   # raises PlanError(problems) or returns None

``graph`` may be None to check only what needs no model (mesh, schedule, kinds, selector syntax).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from planner.batch_stats import find_batch_stat_ops, microbatch_problem, min_rows, rows_problem, unsupported_problem
from planner.buffer_writes import buffer_write_problem, find_buffer_writes
from planner.graph import ModelGraph
from planner.plan import BATCH_NORM_MODES, READABLE_VERSIONS, DP_KINDS, DTYPES, RECOMPUTE_KINDS, DataParallel, Plan, PlanError
from planner.schedule_kinds import KINDS
from planner.messages import describe, json_path_key
from planner.selectors import Selector, format_layers, stage_layers
from planner.validate_fields import (check_choice, check_conflicts, check_matches, check_positive, fp16_problem,
                                     module_names, parse_field)
from planner.validate_tp import check_experts, check_tensor_parallel

__all__ = ["validate_plan", "device_count"]


def validate_plan(plan: Plan, graph: ModelGraph | None, cluster: Any = None, *, devices: int | None = None,
                  source: str = "plan", schema_problems: Sequence[str] = (), runnable: bool = True) -> None:
    """Raise :class:`PlanError` listing every problem of ``plan`` for ``graph`` on the devices.

    The device count is ``devices`` if given, else the count of ``cluster`` (an int, a dict or an
    object with ``num_devices``/``devices``/``world_size``, or ``nodes`` × ``gpus_per_node``), else
    the count recorded in ``plan.cluster``; with none of these the mesh product is not checked.
    ``source`` (a file name) heads the error message. A plan whose fingerprint names another model
    gets only the checks that do not depend on the model, since every selector would miss too.

    ``schema_problems`` are what reading the file found (``Plan.read``): they head the list, and
    the meaning of a section that had one is not judged again (its unreadable fields took their
    defaults, which would only produce follow-on errors).

    ``runnable=False`` judges the plan as something to cost, not to run: what only the runtime
    cannot do yet (fp16 without loss scaling) is not a problem then (``cost_plan``, what-if costing
    of published fp16 runs, the plan the search writes for a cluster it does not run on).
    """
    problems: list[str] = []
    if plan.version not in READABLE_VERSIONS:
        problems.append(f"version: plan version {plan.version} cannot be read; this build reads version "
                        + ", ".join(map(str, READABLE_VERSIONS)))
    if graph is not None and not _check_model(plan, graph, problems):
        graph = None  # every selector would miss too: report only what does not depend on the model
    n, where = _devices(plan, cluster, devices)
    _check_mesh(plan, n, where, problems)
    _check_schedule(plan, problems)
    _check_stages(plan, graph, problems)
    check_tensor_parallel(plan, graph, problems)
    check_experts(plan, graph, problems)
    _check_data_parallel(plan, graph, problems, runnable=runnable)
    _check_recompute(plan, graph, problems)
    _check_batch_norm(plan, graph, problems)
    if graph is not None and (cut := buffer_write_problem(
            find_buffer_writes(graph.gm), dp=plan.mesh.dp, microbatches=plan.schedule.microbatches,
            shards_params=plan.data_parallel.kind == "fsdp")) is not None:
        problems.append(cut)
    broken = {_section(p) for p in schema_problems}
    broken |= {d for s in broken for d in _READS.get(s, ())}
    problems = list(schema_problems) + [p for p in problems if _section(p) not in broken]
    if problems:
        raise PlanError(problems, source=source)


_READS = {"mesh": ("schedule", "stages", "tensor_parallel", "data_parallel"), "schedule": ("stages",)}
"""Sections whose checks read another section's values: an unreadable mesh leaves their verdicts unknown."""


def _section(problem: str) -> str:
    """The top-level plan key a problem is about: ``mesh.tp: ...`` -> ``mesh``."""
    return re.split(r"[.\[:]", problem, maxsplit=1)[0].strip()


# --- devices -----------------------------------------------------------------------------------


def device_count(cluster: Any) -> int | None:
    """Number of devices of a cluster given as an int, a dict or an object; None if it has none."""
    if cluster is None:
        return None
    if isinstance(cluster, int) and not isinstance(cluster, bool):
        return cluster

    def get(key: str) -> Any:
        value = cluster.get(key) if isinstance(cluster, dict) else getattr(cluster, key, None)
        return value() if callable(value) else value

    for key in ("num_devices", "devices", "world_size", "device_count"):
        value = get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, (list, tuple)):
            return len(value)
    nodes, per_node = get("nodes"), get("gpus_per_node") or get("devices_per_node")
    if isinstance(nodes, int) and isinstance(per_node, int):
        last = get("last_node_devices")  # a partial last node (planner.cluster.Cluster)
        return (nodes - 1) * per_node + (last if isinstance(last, int) and last > 0 else per_node)
    return None


def _devices(plan: Plan, cluster: Any, devices: int | None) -> tuple[int | None, str]:
    if devices is not None:
        return devices, "were given"
    n = device_count(cluster)
    if n is not None:
        return n, "are in the cluster"
    n = device_count(plan.cluster)
    if n is None and "preset" in plan.cluster:
        from planner.cluster import Cluster  # a preset record ({"preset": "h100-sxm", "nodes": 2}) names its size

        try:
            n = Cluster.from_dict(plan.cluster).devices
        except (ValueError, TypeError):
            n = None  # an unknown preset: the cluster is informational here, and the mesh stays unchecked
    return n, "are in the plan's cluster"


# --- model -------------------------------------------------------------------------------------


def _check_model(plan: Plan, graph: ModelGraph, problems: list[str]) -> bool:
    """Compare the plan's model reference with ``graph``; False if the plan is for another model."""
    ref = plan.model
    if ref.fingerprint and ref.fingerprint != graph.fingerprint:
        why = "; its parameter names or shapes differ" if ref.class_ == graph.model_class else ""
        problems.append(
            f"model.fingerprint: the plan was made for {ref.class_ or 'a model'} (fingerprint {ref.fingerprint}), "
            f"but this model is {graph.model_class} (fingerprint {graph.fingerprint}){why}; make a new plan "
            "for this model (fairscale plan)")
        return False
    if ref.class_ and ref.class_ != graph.model_class:
        problems.append(f"model.class: the plan was made for {ref.class_}, but this model is {graph.model_class}")
    if ref.parameters and ref.parameters != graph.num_parameters:
        problems.append(f"model.parameters: the plan says {ref.parameters:,}, but this model has "
                        f"{graph.num_parameters:,}")
    return True


# --- mesh and schedule -------------------------------------------------------------------------


def _check_mesh(plan: Plan, n: int | None, where: str, problems: list[str]) -> None:
    m = plan.mesh
    ok = all([check_positive(f"mesh.{axis}", getattr(m, axis), problems) for axis in ("pp", "dp", "tp", "ep")])
    if ok and m.dp % m.ep:
        problems.append(f"mesh.ep: {m.ep} does not divide mesh.dp ({m.dp}); experts are split over groups of "
                        "ep data-parallel ranks, so choose an ep that divides dp")
    if not ok or n is None or m.size == n:
        return
    if m.size < n and where != "were given":
        return  # a plan may leave some of a cluster's devices idle (the search says why); a launch may not
    hint = ""
    if m.size < n and plan.predicted.devices_used == m.size:
        hint = f" (this plan leaves {n - m.size} of its cluster's devices idle: launch {m.size} ranks)"
    elif n % (m.pp * m.tp) == 0:
        hint = f" (e.g. dp {n // (m.pp * m.tp)}: pp({m.pp}) × dp({n // (m.pp * m.tp)}) × tp({m.tp}) = {n})"
    problems.append(f"mesh: pp({m.pp}) × dp({m.dp}) × tp({m.tp}) = {m.size}, but {n} devices {where}; "
                    f"choose degrees whose product is {n}{hint}")


def _check_schedule(plan: Plan, problems: list[str]) -> None:
    s, pp = plan.schedule, plan.mesh.pp
    known = check_choice("schedule.kind", s.kind, tuple(KINDS), "schedule", problems)
    mb_ok = check_positive("schedule.microbatches", s.microbatches, problems)
    v_ok = check_positive("schedule.virtual_stages", s.virtual_stages, problems)
    if known and pp >= 1 and mb_ok and v_ok:
        problems += [f"schedule.{fld}: {msg}" for fld, msg in KINDS[s.kind].problems(pp, s.microbatches,
                                                                                    s.virtual_stages)]
    if not mb_ok:
        return
    if s.global_batch < 0:
        problems.append(f"schedule.global_batch: expected a positive number of samples (or 0: not recorded), "
                        f"got {s.global_batch}")
    elif s.global_batch and plan.mesh.dp >= 1 and s.global_batch % (plan.mesh.dp * s.microbatches):
        parts = plan.mesh.dp * s.microbatches
        problems.append(f"schedule.global_batch: {s.global_batch} samples do not split into dp({plan.mesh.dp}) × "
                        f"microbatches({s.microbatches}) = {parts} equal microbatches ({s.global_batch} % {parts} = "
                        f"{s.global_batch % parts})")


# --- selectors ---------------------------------------------------------------------------------


# --- stages ------------------------------------------------------------------------------------


def _check_stages(plan: Plan, graph: ModelGraph | None, problems: list[str]) -> None:
    pp, v = plan.mesh.pp, plan.schedule.virtual_stages
    need = pp * v
    if not plan.stages:
        if pp >= 1 and v >= 1 and need != 1:
            problems.append(f"stages: empty (one stage holding every layer), but pp({pp}) × virtual_stages({v}) = "
                            f"{need} stages are needed")
        return
    if pp >= 1 and v >= 1 and len(plan.stages) != need:
        problems.append(f"stages: {len(plan.stages)} stage{'s' if len(plan.stages) != 1 else ''} given, but pp({pp}) × virtual_stages({v}) = {need} "
                        "are needed")
    example = graph.layers[0].name if graph is not None and graph.layers else "layers.[0-3]"
    names = [layer.name for layer in graph.layers] if graph is not None else []
    selectors: list[Selector] = []
    readable = True
    for i, st in enumerate(plan.stages):
        sel = parse_field(f"stages[{i}].layers", st.layers, problems, example=example)
        readable = readable and sel is not None
        if sel is None or graph is None:
            continue
        check_matches(f"stages[{i}].layers", sel, names, "layer", problems, modules=module_names(graph))
        selectors.append(sel)
    if graph is None or not readable:
        return  # coverage of a stage we could not read would only repeat that problem
    index = {name: k for k, name in enumerate(names)}
    _check_coverage([[index[n] for n in layers] for layers in stage_layers(selectors, names)], names, problems)


def _check_coverage(held: list[list[int]], names: list[str], problems: list[str]) -> None:
    owners: dict[int, list[int]] = {}
    for s, idx in enumerate(held):
        for k in idx:
            owners.setdefault(k, []).append(s)
    shared: dict[tuple[int, ...], list[str]] = {}
    for k in sorted(owners):
        if len(owners[k]) > 1:
            shared.setdefault(tuple(owners[k]), []).append(names[k])
    for stages, layer_names in shared.items():
        where = " and ".join(f"stages[{s}]" for s in stages)
        problems.append(f"stages: {format_layers(layer_names)} {'is' if len(layer_names) == 1 else 'are'} in {where}; "
                        "each layer must be in exactly one stage")
    missing = [names[k] for k in range(len(names)) if k not in owners]
    if missing:
        problems.append(f"stages: {format_layers(missing)} {'is' if len(missing) == 1 else 'are'} in no stage; "
                        "each layer must be in exactly one stage")
    contiguous = [not idx or idx[-1] - idx[0] + 1 == len(idx) for idx in held]
    for s, idx in enumerate(held):
        if not contiguous[s]:
            gap = [names[k] for k in range(idx[0], idx[-1] + 1) if k not in idx]
            problems.append(f"stages[{s}].layers: not contiguous: it holds {names[idx[0]]} to {names[idx[-1]]} but "
                            f"not {format_layers(gap)} in between; a stage is a contiguous run of layers in "
                            "execution order")
    prev = None
    for s, idx in enumerate(held):
        if not idx:
            continue
        # Order only means something between contiguous stages that do not share layers.
        if prev is not None and idx[0] < held[prev][-1] and contiguous[s] and contiguous[prev] \
                and not set(idx) & set(held[prev]):
            problems.append(f"stages[{s}]: runs before stages[{prev}]: its first layer {names[idx[0]]} is layer "
                            f"{idx[0]}, but stages[{prev}] ends at layer {held[prev][-1]} ({names[held[prev][-1]]}); "
                            "list stages in execution order")
        prev = s


# --- data parallel -----------------------------------------------------------------------------

_FSDP_ONLY = ("units", "reshard_after_forward", "prefetch")



def _check_data_parallel(plan: Plan, graph: ModelGraph | None, problems: list[str], *, runnable: bool) -> None:
    dp = plan.data_parallel
    known = check_choice("data_parallel.kind", dp.kind, DP_KINDS, "data-parallel kind", problems)
    check_choice("data_parallel.param_dtype", dp.param_dtype, DTYPES, "dtype", problems)
    check_choice("data_parallel.reduce_dtype", dp.reduce_dtype, DTYPES, "dtype", problems)
    for name in ("param_dtype", "reduce_dtype") if runnable else ():
        problem = fp16_problem(f"data_parallel.{name}", getattr(dp, name))
        if problem:
            problems.append(problem)
    if dp.bucket_mb <= 0:
        problems.append(f"data_parallel.bucket_mb: expected a positive number of MiB, got {dp.bucket_mb}")
    default = DataParallel()
    if known and dp.kind != "fsdp":
        for name in _FSDP_ONLY:
            value = getattr(dp, name)
            if value != getattr(default, name):
                problems.append(f'data_parallel.{name}: {describe(value)} is an FSDP option, but data_parallel.kind '
                                f'is "{dp.kind}", which would ignore it; remove it or set kind to "fsdp"')
    if known and dp.kind == "fsdp" and dp.bucket_mb != default.bucket_mb:
        problems.append(f'data_parallel.bucket_mb: {dp.bucket_mb} is a DDP/ZeRO option, but data_parallel.kind is '
                        '"fsdp", which would ignore it (FSDP communicates per unit); remove it or set kind to '
                        '"ddp", "zero1" or "zero2"')
    if dp.units and dp.kind == "fsdp":
        sel = parse_field("data_parallel.units", dp.units, problems, example="layers.*")
        if sel is not None and graph is not None:
            check_matches("data_parallel.units", sel, module_names(graph), "module", problems)


# --- recompute ---------------------------------------------------------------------------------


def _check_recompute(plan: Plan, graph: ModelGraph | None, problems: list[str]) -> None:
    parsed: list[tuple[str, Selector, str]] = []
    for key, kind in plan.recompute.items():
        path = json_path_key("recompute", key)
        known = check_choice(path, kind, RECOMPUTE_KINDS, "recompute kind", problems)
        sel = parse_field(path, key, problems, example="layers.[0-3]")
        if sel is None or graph is None:
            continue
        check_matches(path, sel, module_names(graph), "module", problems)
        if known:
            parsed.append((key, sel, kind))
    if graph is not None:
        check_conflicts("recompute", parsed, module_names(graph), "kind", problems)


# --- batch statistics --------------------------------------------------------------------------


def _check_batch_norm(plan: Plan, graph: ModelGraph | None, problems: list[str]) -> None:
    """``"batch_norm": "sync"`` is exact over dp ranks but not across microbatches: refuse those
    (naming the model's batch-statistic ops) unless the plan opts in to ``"local"``; and refuse
    rank microbatches too small for a batch norm in either mode."""
    if not check_choice("batch_norm", plan.batch_norm, BATCH_NORM_MODES, "batch-norm mode", problems):
        return
    if graph is None:
        return
    ops = find_batch_stat_ops(graph.gm)
    if not ops:
        return
    dp, m = plan.mesh.dp, plan.schedule.microbatches
    batch = plan.schedule.global_batch or graph.batch_size
    if dp >= 1 and m >= 1 and batch % (dp * m) == 0 and batch // (dp * m) < min_rows(ops):
        problems.append(rows_problem(ops, batch // (dp * m), dp=dp, microbatches=m))
    if plan.batch_norm != "sync":
        return
    if plan.schedule.microbatches > 1:
        problems.append(microbatch_problem(ops, plan.schedule.microbatches))
    if (plan.mesh.dp > 1 or plan.schedule.microbatches > 1) and any(not op.supported for op in ops):
        problems.append(unsupported_problem(ops))
