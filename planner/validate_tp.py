"""Plan validation of the tensor-parallel rules and of expert parallelism (``mesh.ep``) against a
captured model: styles, selectors, what each style can split (and by how much), attention heads,
and experts split over tp and ep at once. Called by ``planner.validate.validate_plan``."""

from __future__ import annotations

import re

from planner.graph import ModelGraph
from planner.plan import TP_STYLES, Plan
from planner.messages import json_path_key
from planner.selectors import Selector, format_layers
from planner.validate_fields import check_choice, check_conflicts, check_matches, module_names, parse_field

__all__ = ["check_tensor_parallel", "check_experts"]


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


def check_tensor_parallel(plan: Plan, graph: ModelGraph | None, problems: list[str]) -> None:
    tp = plan.mesh.tp
    rules = plan.tensor_parallel.rules
    if tp > 1 and not rules:
        problems.append(f"tensor_parallel.rules: empty, but mesh.tp is {tp}, so the {tp} tp ranks would all "
                        "compute the same thing; add rules or set mesh.tp to 1")
    parsed: list[tuple[str, Selector, str]] = []
    for key, style in rules.items():
        path = json_path_key("tensor_parallel.rules", key)
        known = check_choice(path, style, TP_STYLES, "tensor-parallel style", problems)
        sel = parse_field(path, key, problems, example="layers.*.self_attn.q_proj")
        if sel is None or graph is None:
            continue
        modules = module_names(graph)
        check_matches(path, sel, modules, "module", problems)
        if known:
            parsed.append((key, sel, style))
            if tp >= 1:
                bad = [p for p in (_shard_problem(graph, m, style, tp) for m in sel.select(modules)) if p]
                if bad:
                    more = f" (and {len(bad) - 1} more module{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
                    problems.append(f"{path}: {bad[0]}{more}")
    if graph is None:
        return
    check_conflicts("tensor_parallel.rules", parsed, module_names(graph), "style", problems)
    if tp > 1 and parsed:
        _check_heads(plan, graph, parsed, problems)


def check_experts(plan: Plan, graph: ModelGraph | None, problems: list[str]) -> None:
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
