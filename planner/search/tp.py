"""Default tensor-parallel rules when the caller gives none.

The real pattern detector lives next to the TP pass (``passes/tp/patterns.py``); the planner is
pure and never imports passes, so ``search`` takes rules as data (``tp_rules``: selector -> style)
and uses this fallback only when none are given. It recognizes Megatron's column->row pairs by
module name inside layers that hold attention (``Layer.attention``): q/k/v (or fused qkv)
projections colwise and the output projection rowwise; MLP up/gate (fc1) colwise and down (fc2)
rowwise. A vocabulary embedding (an Embedding whose rows are the largest output dimension of a
Linear that ends the model) becomes ``vocab_embedding`` and that final Linear ``vocab_loss``.
"""

from __future__ import annotations

import re

from planner.graph import ModelGraph
from planner.tp_styles import STYLES, module_shard_problem, param_shapes_by_module

__all__ = ["default_tp_rules", "tp_degrees_allowed", "tp_allowed", "tp_refusal"]

_COLWISE = {"q_proj", "k_proj", "v_proj", "qkv_proj", "query", "key", "value", "c_attn", "Wqkv", "qkv",
            "up_proj", "gate_proj", "fc1", "c_fc", "w1", "w3", "wi", "wi_0", "wi_1", "fc_in", "dense_h_to_4h",
            "query_key_value"}
_ROWWISE = {"o_proj", "out_proj", "c_proj", "down_proj", "fc2", "w2", "wo", "fc_out", "dense_4h_to_h"}


def default_tp_rules(graph: ModelGraph) -> dict[str, str]:
    """Selector -> style rules for the column->row pairs of attention layers and the vocabulary."""
    att_layers = [layer.name for layer in graph.layers if layer.attention]
    rules: dict[str, str] = {}
    for layer in att_layers:
        prefix = layer + "."
        for mod, cls in graph.modules.items():
            if not mod.startswith(prefix) or not cls.endswith("Linear"):
                continue
            leaf = mod.rpartition(".")[2]
            style = "colwise" if leaf in _COLWISE else "rowwise" if leaf in _ROWWISE else None
            if style is not None:
                rules[_generalize(mod[len(prefix):], layer, graph)] = style
    if rules:
        rules.update(_vocab_rules(graph))
    return dict(sorted(rules.items()))


def _generalize(sub: str, layer: str, graph: ModelGraph) -> str:
    """``layers.3`` + ``attn.q_proj`` -> ``layers.*.attn.q_proj`` when the layer is a repeated block."""
    block = next((lay.block for lay in graph.layers if lay.name == layer), None)
    if block:
        return f"{block}.{sub}" if block.endswith("*") else f"{layer}.{sub}"
    generic = re.sub(r"\.(\d+)$", ".*", layer)
    return f"{generic}.{sub}"


def _vocab_rules(graph: ModelGraph) -> dict[str, str]:
    if not graph.layers:
        return {}
    last = graph.layers[-1].name
    head = last if graph.modules.get(last, "").endswith("Linear") else None
    shape = graph.param_shapes.get(f"{head}.weight") if head else None
    if not head or not shape:
        return {}
    out = {head: "vocab_loss"}
    for mod, cls in graph.modules.items():
        if cls.endswith("Embedding") and graph.param_shapes.get(f"{mod}.weight", (0,))[0] == shape[0]:
            out[mod] = "vocab_embedding"
    return out


def tp_degrees_allowed(graph: ModelGraph, tp_rules: dict[str, str], max_tp: int) -> list[int]:
    """Tensor-parallel degrees up to ``max_tp`` for which :func:`tp_allowed` holds."""
    return [t for t in range(1, max_tp + 1) if tp_allowed(graph, tp_rules, t)]


def tp_allowed(graph: ModelGraph, tp_rules: dict[str, str], tp: int) -> bool:
    """Whether ``tp`` divides the heads and kv heads of every layer whose attention the rules split
    and the split dimension of every split weight (``planner.tp_styles``). tp = 1 always is; tp > 1
    needs rules."""
    if tp == 1:
        return True
    if not tp_rules:
        return False
    from planner.selectors import parse_selector
    from planner.validate_tp import heads_problems

    parsed = [(text, parse_selector(text), style) for text, style in tp_rules.items()]
    if heads_problems(graph, parsed, tp):
        return False
    by_module = param_shapes_by_module(graph)
    for sel_text, style in tp_rules.items():
        if style not in STYLES:
            return False
        sel = parse_selector(sel_text)
        for mod in sel.select(graph.modules):
            if module_shard_problem(graph, mod, style, tp, by_module=by_module) is not None:
                return False
    return True



def tp_refusal(graph: ModelGraph, tp_rules: dict[str, str], tp: int, *, devices: int, per_node: int) -> str:
    """Why ``tp`` is not allowed, in words: the devices, the missing rules (with the detector's
    reason when it gave one: the op and source line it could not shard), the heads, or the first
    weight dimension that does not divide."""
    from planner.selectors import parse_selector
    from planner.validate_tp import heads_problems

    if devices % tp or per_node % tp:
        return f"tp must divide the {per_node} devices of a node and the {devices} devices"
    reason = getattr(tp_rules, "reason", "")
    if not tp_rules:
        return (f"no tensor-parallel rules at tp={tp}: {reason}. {_REMEDY}" if reason else
                "tp > 1 needs tensor_parallel rules, and none were given or found: no Linear, Conv1D or Embedding "
                f"module of the model pairs up for tensor parallelism; its largest op is{_site(graph)}. "
                f"{_REMEDY}")
    parsed = [(text, parse_selector(text), style) for text, style in tp_rules.items()]
    heads = heads_problems(graph, parsed, tp)
    if heads:
        return heads[0].removeprefix("mesh.tp: ")
    by_module = param_shapes_by_module(graph)
    for text, _, style in parsed:
        for mod in parse_selector(text).select(graph.modules):
            problem = module_shard_problem(graph, mod, style, tp, by_module=by_module)
            if problem:
                return f"rule {text!r}: {problem} (its op{_site(graph, mod)}). {_REMEDY}"
    return reason or "the tensor-parallel rules do not apply at this degree"


_REMEDY = "Use tp=1 (leave mesh.tp out of the constraints), or give tensor_parallel rules for modules it can split"


def _site(graph: ModelGraph, module: str | None = None) -> str:
    """`` aten.conv2d.default in module inc.0 (Conv2d) at model.py:31``: the op with the most
    forward FLOPs (in ``module`` when given) and the user's line that runs it."""
    from planner.capture_errors import node_site
    from planner.graph import META_FLOPS_FWD, META_MODULE

    nodes = [n for n in graph.gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
             and (module is None or n.meta.get(META_MODULE) == module)]
    if not nodes:
        return ""
    node = max(nodes, key=lambda n: n.meta.get(META_FLOPS_FWD) or 0)
    path = str(node.meta.get(META_MODULE, ""))
    where = node_site(node)
    return (f" {node.target} in module {path or '(the model)'}"
            + (f" ({graph.modules[path]})" if path in graph.modules else "")
            + (f" at {where[0].rpartition('/')[2]}:{where[1]}" if where else ""))
