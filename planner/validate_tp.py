"""Plan validation of the tensor-parallel rules and of expert parallelism (``mesh.ep``) against a
captured model: styles, selectors, what each style can split (and by how much), attention heads,
and experts split over tp and ep at once. Called by ``planner.validate.validate_plan``."""

from __future__ import annotations

import re
import weakref

from planner.graph import META_PARAM, Layer, ModelGraph
from planner.messages import json_path_key
from planner.plan import Plan
from planner.selectors import Selector, format_layers
from planner.tp_styles import (STYLES, TP_STYLES, module_kind, module_shard_problem, own_param_shapes,
                               param_shapes_by_module, split_dim)
from planner.validate_fields import check_choice, check_conflicts, check_matches, module_names, parse_field

__all__ = ["check_tensor_parallel", "check_experts", "heads_problems", "head_splitting_rules", "tied_layout"]


def check_tensor_parallel(plan: Plan, graph: ModelGraph | None, problems: list[str]) -> None:
    tp = plan.mesh.tp
    rules = plan.tensor_parallel.rules
    if tp > 1 and not rules:
        problems.append(f"tensor_parallel.rules: empty, but mesh.tp is {tp}, so the {tp} tp ranks would all "
                        "compute the same thing; add rules or set mesh.tp to 1")
    parsed: list[tuple[str, Selector, str]] = []
    by_module: dict[str, dict[str, tuple[int, ...]]] | None = None
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
                by_module = by_module or param_shapes_by_module(graph)
                bad = [p for p in (module_shard_problem(graph, m, style, tp, by_module=by_module)
                                   for m in sel.select(modules)) if p]
                if bad:
                    more = f" (and {len(bad) - 1} more module{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
                    problems.append(f"{path}: {bad[0]}{more}")
    if graph is None:
        return
    check_conflicts("tensor_parallel.rules", parsed, module_names(graph), "style", problems)
    if tp > 1 and parsed:
        _check_heads(plan, graph, parsed, problems)
        _check_tied(graph, parsed, problems)


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


def tied_layout(graph: ModelGraph, key: str, parsed: list[tuple[str, Selector, str]]) -> tuple[str | None, int | None]:
    """(rule key, split dim or None for whole) that the rules give parameter ``key``."""
    module, _, leaf = key.rpartition(".")
    hit = next(((text, style) for text, sel, style in parsed if sel.matches(module)), None)
    if hit is None:
        return None, None
    text, style = hit
    st = STYLES[style]
    kind = module_kind(graph.modules.get(module, "?"), own_param_shapes(graph, module))
    if leaf == "weight" or kind == "experts":
        return text, split_dim(style, kind)
    if leaf == "bias" and st.bias == "split":
        return text, 0
    return text, None


def used_keys(graph: ModelGraph) -> set[str]:
    """State-dict keys the captured graph reads a parameter or buffer through: a tied tensor is
    read under the key of each module that uses it (``planner.layers.split_tied_uses``), so a key
    of a module that only owns it (BERT's ``cls.predictions.bias``, read by the decoder as
    ``cls.predictions.decoder.bias``; T5's ``shared.weight``) is not among them."""
    keys = {str(n.meta[META_PARAM]) for n in graph.gm.graph.nodes if n.op == "get_attr" and META_PARAM in n.meta}
    return keys or {k for group in graph.tied for k in group}  # a graph without parameter facts: every key


def tied_conflicts(graph: ModelGraph, parsed: list[tuple[str, Selector, str]]
                   ) -> list[tuple[list[str], dict[str, tuple[str | None, int | None]]]]:
    """Tied groups whose used keys the rules give different layouts, each with its keys' (rule
    key, split dim) (:func:`tied_layout`). Keys the graph never reads have no layout of their own."""
    used = used_keys(graph)
    out = []
    for group in graph.tied:
        layouts = {k: tied_layout(graph, k, parsed) for k in group if k in used}
        if len({dim for _, dim in layouts.values()}) > 1:
            out.append((group, layouts))
    return out


def _check_tied(graph: ModelGraph, parsed: list[tuple[str, Selector, str]], problems: list[str]) -> None:
    """Every tied group gets one layout: its copies (one per pipeline stage that reads it) are
    summed after backward, which needs the same piece of the tensor on every copy."""
    for group, layouts in tied_conflicts(graph, parsed):
        parts = []
        for k, (text, dim) in layouts.items():
            how = "kept whole" if dim is None else f"split on dim {dim}"
            why = f"rule {json_path_key('tensor_parallel.rules', text)}" if text else "no rule"
            parts.append(f"{k} is {how} ({why})")
        problems.append(f"tensor_parallel.rules: the tied weights {group} must have one layout, but "
                        f"{'; '.join(parts)}. Give every module that uses the tied tensor a matching style "
                        "(an embedding with vocab_embedding and its tied LM head with vocab_loss split the same "
                        "vocabulary rows), or replicate all of them")


_ATTENTION = re.compile(r"Attention")
"""Class names of attention modules (LlamaAttention, GPT2Attention, nn.MultiheadAttention, ours)."""


def _check_heads(plan: Plan, graph: ModelGraph, parsed: list[tuple[str, Selector, str]],
                 problems: list[str]) -> None:
    problems.extend(heads_problems(graph, parsed, plan.mesh.tp))


_ATTENTION_MODULES: dict[int, list[tuple[Layer, list[str]]]] = {}  # id(graph) -> while the graph lives


def _attention_modules(graph: ModelGraph) -> list[tuple[Layer, list[str]]]:
    """Each layer with attention, and the modules whose sharding splits its heads: those inside its
    attention module (an MLP-only rule splits no heads), or inside the layer when no module is
    named like one. Per graph (the search asks at every tp degree)."""
    if id(graph) not in _ATTENTION_MODULES:
        found = []
        for layer in graph.layers:
            if not layer.attention:
                continue
            inside = [m for m in graph.modules if m == layer.name or m.startswith(layer.name + ".")]
            roots = [m for m in inside if _ATTENTION.search(graph.modules[m])]
            if roots:
                inside = [m for m in inside if any(m == r or m.startswith(r + ".") for r in roots)]
            found.append((layer, inside))
        _ATTENTION_MODULES[id(graph)] = found
        weakref.finalize(graph, _ATTENTION_MODULES.pop, id(graph), None)
    return _ATTENTION_MODULES[id(graph)]


def heads_problems(graph: ModelGraph, parsed: list[tuple[str, Selector, str]], tp: int) -> list[str]:
    """Attention layers whose heads the rules split although tp does not divide their heads and
    kv heads (an MLP-only rule splits no heads), each naming the first such attention's module, op
    and source line, and what to do (multi-query attention, one kv head, trains exactly with the
    MLP split and the attention whole)."""
    bad = _head_splits(graph, parsed, tp)
    return [f"mesh.tp: tp({tp}) does not divide the attention heads of {format_layers([l.name for l, _ in found])} "
            f"(heads {heads} % {tp} = {heads % tp}, kv_heads {kv} % {tp} = {kv % tp}){_heads_site(graph, found[0][1])}; "
            "each tp rank must hold whole heads, so use a tp that divides both, or keep the attention whole: "
            "tensor_parallel.rules for the other modules only (the MLP), none for the attention's"
            for (heads, kv), (found, _) in bad.items()]


def head_splitting_rules(graph: ModelGraph, parsed: list[tuple[str, Selector, str]], tp: int) -> set[str]:
    """The rules (their selector texts) of :func:`heads_problems`: those that split the heads of an
    attention whose heads or kv heads ``tp`` does not divide."""
    return {text for _, texts in _head_splits(graph, parsed, tp).values() for text in texts}


def _head_splits(graph: ModelGraph, parsed: list[tuple[str, Selector, str]], tp: int
                 ) -> dict[tuple[int, int], tuple[list[tuple[Layer, list[str]]], set[str]]]:
    """(heads, kv heads) -> the attention layers whose heads the rules split although ``tp`` does
    not divide them (each with its modules), and the rules that split them."""
    bad: dict[tuple[int, int], tuple[list[tuple[Layer, list[str]]], set[str]]] = {}
    for layer, inside in _attention_modules(graph):
        att = layer.attention or {}
        heads, kv = att.get("heads", 0), att.get("kv_heads", att.get("heads", 0))
        if not (heads % tp or kv % tp):  # whole heads on every rank, whatever the rules split
            continue
        texts = {text for text, sel, style in parsed if style != "replicate" and any(sel.matches(m) for m in inside)}
        if texts:
            layers, found = bad.setdefault((heads, kv), ([], set()))
            layers.append((layer, inside))
            found |= texts
    return bad


def _heads_site(graph: ModelGraph, inside: list[str]) -> str:
    """`` at module M (Class), op O, source file.py:N``: the attention's op with the most forward
    FLOPs among ``inside`` (its modules), or ''."""
    from planner.capture_errors import node_site
    from planner.graph import META_FLOPS_FWD, META_MODULE

    members = set(inside)
    nodes = [n for n in graph.gm.graph.nodes if n.op == "call_function" and n.meta.get(META_MODULE) in members]
    if not nodes:
        return ""
    node = max(nodes, key=lambda n: n.meta.get(META_FLOPS_FWD) or 0)
    path = str(node.meta[META_MODULE])
    where = node_site(node)
    return (f" at module {path} ({graph.modules.get(path, '?')}), op {node.target}"
            + (f", source {where[0].rpartition('/')[2]}:{where[1]}" if where else ""))
