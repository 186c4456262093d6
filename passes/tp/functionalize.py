"""Turn safe in-place ops of a captured graph into their functional forms before tensor parallelism.

``torch.export``'s training IR keeps in-place ops (``out += identity`` is ``aten.add_.Tensor``,
``nn.ReLU(inplace=True)`` is ``aten.relu_.default``). An in-place op cannot change its input's
placement (the mutated tensor is the input), so on a partial sum or a shard it would need its input
converted first, which the TP pass refuses. Most in-place ops mutate a fresh intermediate that
nothing else aliases; for those ``y = op_(a, ...)`` is the same as ``y = op(a, ...)`` followed by
every later reader of ``a`` reading ``y`` instead, which is what this pass writes.

An in-place op stays as it is (and the TP rules then refuse what they cannot do in place) when its
mutation could be seen elsewhere: the mutated value is a graph input, a parameter or buffer, a view
of another value (its producer's schema says its output aliases an input), or another view of it was
taken before the mutation.

node.meta is kept on the rewritten nodes (``val``, ``fs_module``, ``stack_trace`` ...).
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from planner.fx_module import graph_module

__all__ = ["functionalize_inplace", "functional_of", "is_inplace"]

aten = torch.ops.aten


def is_inplace(target: Any) -> bool:
    """Whether ``target`` is an ATen overload that writes its first (``self``) argument."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    info = schema.arguments[0].alias_info
    return bool(info is not None and info.is_write and schema.name.endswith("_"))


def functional_of(target: Any) -> Any | None:
    """``aten.add_.Tensor`` -> ``aten.add.Tensor`` (None when there is no functional twin)."""
    if not is_inplace(target):
        return None
    schema = target._schema
    base = schema.name.split("::")[-1][:-1]
    packet = getattr(aten, base, None)
    overload = schema.overload_name or "default"
    return getattr(packet, overload, None) if packet is not None else None


def _aliases_input(node: Node) -> bool:
    """Whether ``node``'s value may be a view of another value."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op != "call_function":
        return True
    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, Node) and _aliases_input(src)
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True  # an unknown function may return its argument
    return any(r.alias_info is not None for r in schema.returns)


def _is_view(node: Node) -> bool:
    return node.op == "call_function" and node.target is not operator.getitem and _aliases_input(node) \
        and not is_inplace(node.target)


def functionalize_inplace(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` with every safe in-place op functional (see the module docstring); ``gm``
    itself when there is none. Parameters are shared with ``gm``, ``gm.meta`` is copied."""
    candidates = [n for n in gm.graph.nodes if n.op == "call_function" and functional_of(n.target) is not None]
    if not candidates:
        return gm
    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    env: dict[Node, Node] = {}
    result = graph.graph_copy(gm.graph, env)
    old_out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    graph.output(result, type_expr=old_out.type).meta = dict(old_out.meta)
    order = {n: i for i, n in enumerate(graph.nodes)}
    changed = 0
    for old in candidates:
        node = env[old]
        mutated = node.args[0]
        if not isinstance(mutated, Node) or _aliases_input(mutated):
            continue
        if any(_is_view(u) and order[u] < order[node] for u in mutated.users):
            continue
        functional = functional_of(node.target)
        assert functional is not None  # checked above with the other conditions
        with graph.inserting_before(node):
            new = graph.call_function(functional, node.args, node.kwargs)
        new.meta = dict(node.meta)
        order[new] = order[node]
        later = [u for u in mutated.users if u is not node and u is not new and order[u] > order[node]]
        node.replace_all_uses_with(new)
        for u in later:
            u.replace_input_with(mutated, new)
        graph.erase_node(node)
        changed += 1
    if not changed:
        return gm
    graph.lint()
    out = graph_module(gm, graph, class_name=type(gm).__name__)
    out.meta = dict(gm.meta)
    return out
