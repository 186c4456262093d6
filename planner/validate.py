"""Check a plan against a captured model and a device count; report every problem at once.

``planner.plan_io`` checks the file's shape (keys, types, version); this module checks what the
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

from planner.graph import ModelGraph
from planner.plan import DP_KINDS, DTYPES, RECOMPUTE_KINDS, SCHEDULES, TP_STYLES, DataParallel, Plan, PlanError
from planner.plan_io import READABLE_VERSIONS, closest, describe, json_path_key
from planner.selectors import Selector, SelectorError, format_layers, parse_selector, suggest

__all__ = ["validate_plan", "device_count"]


def validate_plan(plan: Plan, graph: ModelGraph | None, cluster: Any = None, *, devices: int | None = None,
                  source: str = "plan") -> None:
    """Raise :class:`PlanError` listing every problem of ``plan`` for ``graph`` on the devices.

    The device count is ``devices`` if given, else the count of ``cluster`` (an int, a dict or an
    object with ``num_devices``/``devices``/``world_size``, or ``nodes`` × ``gpus_per_node``), else
    the count recorded in ``plan.cluster``; with none of these the mesh product is not checked.
    ``source`` (a file name) heads the error message. A plan whose fingerprint names another model
    gets only the checks that do not depend on the model, since every selector would miss too.
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
    _check_tensor_parallel(plan, graph, problems)
    _check_experts(plan, graph, problems)
    _check_data_parallel(plan, graph, problems)
    _check_recompute(plan, graph, problems)
    if problems:
        raise PlanError(problems, source=source)


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
        return nodes * per_node
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


def _positive(path: str, value: int, problems: list[str]) -> bool:
    if value < 1:
        problems.append(f"{path}: expected a positive integer, got {value}")
        return False
    return True


def _check_mesh(plan: Plan, n: int | None, where: str, problems: list[str]) -> None:
    m = plan.mesh
    ok = all([_positive(f"mesh.{axis}", getattr(m, axis), problems) for axis in ("pp", "dp", "tp", "ep")])
    if ok and m.dp % m.ep:
        problems.append(f"mesh.ep: {m.ep} does not divide mesh.dp ({m.dp}); experts are split over groups of "
                        "ep data-parallel ranks, so choose an ep that divides dp")
    if not ok or n is None or m.size == n:
        return
    hint = ""
    if n % (m.pp * m.tp) == 0:
        hint = f" (e.g. dp {n // (m.pp * m.tp)}: pp({m.pp}) × dp({n // (m.pp * m.tp)}) × tp({m.tp}) = {n})"
    problems.append(f"mesh: pp({m.pp}) × dp({m.dp}) × tp({m.tp}) = {m.size}, but {n} devices {where}; "
                    f"choose degrees whose product is {n}{hint}")


_ALIASES = {"zero3": "fsdp", "zero-3": "fsdp", "bfloat16": "bf16", "float32": "fp32", "float16": "fp16",
            "half": "fp16", "float": "fp32", "pipedream": "1f1b", "interleaved_1f1b": "interleaved"}
"""Names other tools use for our values (ZeRO-3 is what FSDP does; torch dtype names)."""


def _enum(path: str, value: str, allowed: Sequence[str], what: str, problems: list[str]) -> bool:
    if value in allowed:
        return True
    close = _ALIASES.get(value.lower()) if value.lower() in _ALIASES else None
    close = close if close in allowed else closest(value, allowed)
    hint = f'did you mean "{close}"? ' if close else ""
    quoted = ", ".join(f'"{a}"' for a in allowed)
    problems.append(f"{path}: unknown {what} {describe(value)}; {hint}(allowed: {quoted})")
    return False


def _check_schedule(plan: Plan, problems: list[str]) -> None:
    s, pp = plan.schedule, plan.mesh.pp
    known = _enum("schedule.kind", s.kind, SCHEDULES, "schedule", problems)
    mb_ok = _positive("schedule.microbatches", s.microbatches, problems)
    v_ok = _positive("schedule.virtual_stages", s.virtual_stages, problems)
    if not known or pp < 1:
        return
    if v_ok and s.kind == "v" and s.virtual_stages != 2:
        problems.append(f'schedule.virtual_stages: kind "v" places two chunks on each pipeline rank (down, then '
                        f"back up), so it needs virtual_stages 2, got {s.virtual_stages}")
    elif v_ok and s.virtual_stages > 1 and s.kind not in ("interleaved", "v"):
        problems.append(f"schedule.virtual_stages: {s.virtual_stages} model chunks per pipeline rank need kind "
                        f'"interleaved", but schedule.kind is "{s.kind}"; set kind to "interleaved" or '
                        "virtual_stages to 1")
    if not mb_ok:
        return
    if s.kind == "1f1b" and s.microbatches < pp:
        problems.append(
            f"schedule.microbatches: 1f1b with pp({pp}) needs at least {pp} microbatches, got {s.microbatches}: "
            f"its warm-up sends one microbatch into each of the {pp} stages before the first backward, so with "
            f'fewer the pipeline never fills; use {pp} or more, or kind "gpipe"')
    if s.global_batch < 0:
        problems.append(f"schedule.global_batch: expected a positive number of samples (or 0: not recorded), "
                        f"got {s.global_batch}")
    elif s.global_batch and plan.mesh.dp >= 1 and s.global_batch % (plan.mesh.dp * s.microbatches):
        parts = plan.mesh.dp * s.microbatches
        problems.append(f"schedule.global_batch: {s.global_batch} samples do not split into dp({plan.mesh.dp}) × "
                        f"microbatches({s.microbatches}) = {parts} equal microbatches ({s.global_batch} % {parts} = "
                        f"{s.global_batch % parts})")
    if s.kind == "interleaved" and s.microbatches % pp:
        problems.append(
            f"schedule.microbatches: interleaved runs microbatches in rounds of pp({pp}) "
            f"(Narayanan et al. 2021, sec. 2.2), so it needs a multiple of {pp}; {s.microbatches} % {pp} = "
            f"{s.microbatches % pp}")


# --- selectors ---------------------------------------------------------------------------------


def _parse(path: str, text: str, problems: list[str], *, example: str) -> Selector | None:
    if not text.strip():
        problems.append(f'{path}: empty; write a selector, e.g. "{example}"')
        return None
    try:
        return parse_selector(text)
    except SelectorError as exc:
        problems.append(f"{path}: {exc}")
        return None


def _unmatched(path: str, sel: Selector, names: Sequence[str], what: str, problems: list[str],
               *, modules: Sequence[str] = ()) -> None:
    """Report each pattern of ``sel`` that selects none of ``names`` (``what``: layer or module)."""
    for pat in sel.unmatched(names):
        hits = parse_selector(pat).select(modules)
        held = [n for n in names if any(n.startswith(h + ".") for h in hits)]
        if held:  # a container of layers, e.g. "model.layers"
            problems.append(f'{path}: "{pat}" matches {_short(hits)}, which holds layers {_short(held)}; a stage '
                            f'lists layers, e.g. "{format_layers(held)}"')
            continue
        owners = [n for n in names if any(h.startswith(n + ".") for h in hits)]
        if owners:
            problems.append(f'{path}: "{pat}" matches {_short(hits)}, inside layer{"s" if len(owners) > 1 else ""} '
                            f"{_short(owners)}; a stage holds whole layers (layers are: {_outline(names)})")
            continue
        fix = suggest(pat, list(names) + list(modules))
        hint = f'; did you mean "{fix}"?' if fix else f" ({what}s are: {_outline(names)})"
        problems.append(f'{path}: "{pat}" matches no {what}{hint}')


def _modules(graph: ModelGraph) -> list[str]:
    return [m for m in graph.modules if m]


def _outline(names: Sequence[str], limit: int = 8) -> str:
    """Module paths with integer segments folded to ``*``, deduplicated: the shape of the model."""
    seen: list[str] = []
    for name in names:
        folded = ".".join("*" if seg.isdigit() else seg for seg in name.split("."))
        if folded not in seen:
            seen.append(folded)
    more = f", ... ({len(seen) - limit} more)" if len(seen) > limit else ""
    return ", ".join(seen[:limit]) + more


def _short(names: Sequence[str], limit: int = 3) -> str:
    text = format_layers(list(names))
    parts = text.split(", ")
    return text if len(parts) <= limit else ", ".join(parts[:limit]) + f", ... ({len(parts) - limit} more)"


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
    held: list[list[int]] = []
    readable = True
    for i, st in enumerate(plan.stages):
        sel = _parse(f"stages[{i}].layers", st.layers, problems, example=example)
        readable = readable and sel is not None
        if sel is None or graph is None:
            continue
        _unmatched(f"stages[{i}].layers", sel, names, "layer", problems, modules=_modules(graph))
        held.append([k for k, name in enumerate(names) if sel.matches(name)])
    if graph is None or not readable:
        return  # coverage of a stage we could not read would only repeat that problem
    _check_coverage(held, names, problems)


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


# --- tensor parallel ---------------------------------------------------------------------------

# Which dim of ``weight`` a style splits, by module kind. HF's Conv1D stores weight as (in, out).
_SHARD_DIM: dict[str, dict[str, int]] = {
    "colwise": {"linear": 0, "conv1d": 1, "embedding": 1},
    "colwise_gather": {"linear": 0, "conv1d": 1, "embedding": 1},
    "rowwise": {"linear": 1, "conv1d": 0, "embedding": 0},
    "vocab_embedding": {"embedding": 0},
    "vocab_loss": {"linear": 0, "conv1d": 1},
}
_DIM_NAME = {("linear", 0): "output features", ("linear", 1): "input features", ("conv1d", 1): "output features",
             ("conv1d", 0): "input features", ("embedding", 0): "vocabulary rows",
             ("embedding", 1): "embedding columns"}


def _kind(cls: str) -> str | None:
    if cls.endswith("Linear"):
        return "linear"
    if cls == "Conv1D":
        return "conv1d"
    if cls.endswith("Embedding"):
        return "embedding"
    return None


def _own_params(graph: ModelGraph, module: str) -> dict[str, tuple[int, ...]]:
    prefix = module + "." if module else ""
    return {k[len(prefix):]: s for k, s in graph.param_shapes.items()
            if k.startswith(prefix) and "." not in k[len(prefix):]}


def _shard_problem(graph: ModelGraph, module: str, style: str, tp: int) -> str | None:
    """Why ``style`` cannot shard ``module`` over tp ranks, or None."""
    if style == "replicate":
        return None
    params = _own_params(graph, module)
    cls = graph.modules.get(module, "?")
    if style == "expert":
        if not params:
            return f"expert shards the experts (dim 0) of a module's own parameters, but {module} ({cls}) has none"
        for name, shape in params.items():
            if shape and shape[0] % tp:
                return (f"expert splits {module}.{name} {shape} along dim 0 ({shape[0]} experts), but {shape[0]} % "
                        f"tp({tp}) = {shape[0] % tp}")
        return None
    kind = _kind(cls)
    dims = _SHARD_DIM[style]
    weight = params.get("weight")
    if kind not in dims or weight is None or len(weight) != 2:
        kinds = sorted({"Linear" if k == "linear" else "Conv1D" if k == "conv1d" else "Embedding" for k in dims})
        return f"{style} applies to {' / '.join(kinds)} modules, but {module} is {cls}"
    dim = dims[kind]
    size = weight[dim]
    if size % tp:
        return (f"{style} splits {module}.weight {weight} along dim {dim} ({size} {_DIM_NAME[(kind, dim)]}), "
                f"but {size} % tp({tp}) = {size % tp}")
    return None


def _check_tensor_parallel(plan: Plan, graph: ModelGraph | None, problems: list[str]) -> None:
    tp = plan.mesh.tp
    rules = plan.tensor_parallel.rules
    if tp > 1 and not rules:
        problems.append(f"tensor_parallel.rules: empty, but mesh.tp is {tp}, so the {tp} tp ranks would all "
                        "compute the same thing; add rules or set mesh.tp to 1")
    parsed: list[tuple[str, Selector, str]] = []
    for key, style in rules.items():
        path = json_path_key("tensor_parallel.rules", key)
        known = _enum(path, style, TP_STYLES, "tensor-parallel style", problems)
        sel = _parse(path, key, problems, example="layers.*.self_attn.q_proj")
        if sel is None or graph is None:
            continue
        modules = _modules(graph)
        _unmatched(path, sel, modules, "module", problems)
        if known:
            parsed.append((key, sel, style))
            if tp >= 1:
                bad = [p for p in (_shard_problem(graph, m, style, tp) for m in sel.select(modules)) if p]
                if bad:
                    more = f" (and {len(bad) - 1} more module{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
                    problems.append(f"{path}: {bad[0]}{more}")
    if graph is None:
        return
    _conflicts("tensor_parallel.rules", parsed, _modules(graph), "style", problems)
    if tp > 1 and parsed:
        _check_heads(plan, graph, parsed, problems)


def _check_experts(plan: Plan, graph: ModelGraph | None, problems: list[str]) -> None:
    ep = plan.mesh.ep
    if graph is None or ep <= 1:
        return
    experts = graph.experts()
    if not experts:
        problems.append(f"mesh.ep: {ep}, but {graph.model_class} has no mixture-of-experts layer (Hugging Face "
                        "grouped experts); set mesh.ep to 1")
        return
    for module, facts in experts.items():
        if facts.num_experts % ep:
            problems.append(f"mesh.ep: {ep} does not divide the {facts.num_experts} experts of {module}")
            return
    styled = [key for key, style in plan.tensor_parallel.rules.items() if style == "expert"]
    if styled and plan.mesh.tp > 1:
        problems.append(f"{json_path_key('tensor_parallel.rules', styled[0])}: the experts are split over the ep "
                        f"axis (mesh.ep = {ep}); they cannot also be split over tp. Use 'replicate' for them, "
                        "or set mesh.ep to 1")


_ATTENTION = re.compile(r"Attention")
"""Class names of attention modules (LlamaAttention, GPT2Attention, nn.MultiheadAttention, ours)."""


def _check_heads(plan: Plan, graph: ModelGraph, parsed: list[tuple[str, Selector, str]],
                 problems: list[str]) -> None:
    tp = plan.mesh.tp
    bad: dict[tuple[int, int], list[str]] = {}
    for layer in graph.layers:
        att = layer.attention
        if not att:
            continue
        inside = [m for m in graph.modules if m == layer.name or m.startswith(layer.name + ".")]
        # Only sharding inside the attention module splits heads (an MLP-only rule does not).
        roots = [m for m in inside if _ATTENTION.search(graph.modules[m])]
        if roots:
            inside = [m for m in inside if any(m == r or m.startswith(r + ".") for r in roots)]
        if not any(style != "replicate" and sel.select(inside) for _, sel, style in parsed):
            continue
        heads, kv = att.get("heads", 0), att.get("kv_heads", att.get("heads", 0))
        if heads % tp or kv % tp:
            bad.setdefault((heads, kv), []).append(layer.name)
    for (heads, kv), layers in bad.items():
        problems.append(f"mesh.tp: tp({tp}) does not divide the attention heads of {format_layers(layers)} "
                        f"(heads {heads} % {tp} = {heads % tp}, kv_heads {kv} % {tp} = {kv % tp}); each tp rank "
                        "must hold whole heads, so use a tp that divides both")


def _conflicts(path: str, parsed: list[tuple[str, Selector, str]], modules: list[str], what: str,
               problems: list[str]) -> None:
    """Report modules that two selectors give different values."""
    seen: dict[tuple[int, int], list[str]] = {}
    for m in modules:
        hits = [i for i, (_, sel, _) in enumerate(parsed) if sel.matches(m)]
        for a in hits:
            for b in hits:
                if a < b and parsed[a][2] != parsed[b][2]:
                    seen.setdefault((a, b), []).append(m)
    for (a, b), mods in seen.items():
        (ka, _, va), (kb, _, vb) = parsed[a], parsed[b]
        problems.append(f'{path}: {_short(mods)} {"is" if len(mods) == 1 else "are"} matched by "{ka}" ({va}) and by '
                        f'"{kb}" ({vb}); give each module one {what} by narrowing a selector')


# --- data parallel -----------------------------------------------------------------------------

_FSDP_ONLY = ("units", "reshard_after_forward", "prefetch")


def _check_data_parallel(plan: Plan, graph: ModelGraph | None, problems: list[str]) -> None:
    dp = plan.data_parallel
    known = _enum("data_parallel.kind", dp.kind, DP_KINDS, "data-parallel kind", problems)
    _enum("data_parallel.param_dtype", dp.param_dtype, DTYPES, "dtype", problems)
    _enum("data_parallel.reduce_dtype", dp.reduce_dtype, DTYPES, "dtype", problems)
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
        sel = _parse("data_parallel.units", dp.units, problems, example="layers.*")
        if sel is not None and graph is not None:
            _unmatched("data_parallel.units", sel, _modules(graph), "module", problems)


# --- recompute ---------------------------------------------------------------------------------


def _check_recompute(plan: Plan, graph: ModelGraph | None, problems: list[str]) -> None:
    parsed: list[tuple[str, Selector, str]] = []
    for key, kind in plan.recompute.items():
        path = json_path_key("recompute", key)
        known = _enum(path, kind, RECOMPUTE_KINDS, "recompute kind", problems)
        sel = _parse(path, key, problems, example="layers.[0-3]")
        if sel is None or graph is None:
            continue
        _unmatched(path, sel, _modules(graph), "module", problems)
        if known:
            parsed.append((key, sel, kind))
    if graph is not None:
        _conflicts("recompute", parsed, _modules(graph), "kind", problems)
