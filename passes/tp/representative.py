"""A smaller graph that the tensor-parallel pass accepts or refuses as it does the whole model.

The pattern detector (``passes.tp.patterns``) checks its proposal by running the pass on the
captured graph. A 128-block GPT repeats one block 128 times, and the pass's rewrite costs the same
for each copy: about a second of the time ``fairscale plan`` takes for a 1T model. Here each family
of repeated layers (``layers.0``, ``layers.1``, ... named alike) keeps its first two members and
drops the members that ``planner.replicate.replica_map`` proves to be exact copies of the second
(same ops, constants, wiring and parameter shapes; the first is the template's neighbour, not a
copy, since it also runs the glue after the embeddings). A value that a dropped layer computed is
read, wherever it is used outside the dropped layers, from the same position in the second member:
same op, shapes and dtype. Rules select modules by generalized paths (``layers.*.attn.q_proj``),
so a kept member meets the same styles a dropped one would.

This is what the detector proposes from, not a proof: the pass could still take another way on a
later copy whose input arrives laid out differently. The plan the search chooses is compiled on the
whole model, at its own degree, before it is returned and again before it runs.
"""

from __future__ import annotations

import re

import torch
import torch.fx
from torch.fx import Node

from planner.fx_module import graph_module
from planner.graph import META_LAYER, Layer, impure
from planner.replicate import replica_map

__all__ = ["generalize", "representative"]

_NUMBERED = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def generalize(path: str) -> str:
    """``layers.3.attn`` -> ``layers.*.attn``: the path with its numbered parts as ``*``."""
    return _NUMBERED.sub("*", path)


def representative(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with the exact copies among its repeated layers dropped (see the module docstring);
    ``gm`` itself when nothing repeats three times or more. Parameters are shared with ``gm``."""
    layers: dict[str, Layer] = {}
    for node in gm.graph.nodes:
        name = node.meta.get(META_LAYER)
        if node.op == "call_function" and name:  # parameters are compared by shape (replica_map)
            layer = layers.setdefault(name, Layer(name=name, index=len(layers)))
            layer.nodes.append(node.name)
    families: dict[str, list[str]] = {}
    for name in layers:
        families.setdefault(generalize(name), []).append(name)
    blocks = {key: members for key, members in families.items() if "*" in key and len(members) >= 3}
    if not blocks:
        return gm
    pairs = replica_map(gm, list(layers.values()), blocks)
    dropped: dict[str, str] = {}
    for members in blocks.values():
        for member in members[2:]:  # a run of proven copies right after the template
            names = layers[member].nodes
            if not all(n in pairs for n in names):
                break
            dropped.update((n, pairs[n]) for n in names)
    if not dropped:
        return gm
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    env: dict[Node, Node] = {}
    by_name = {n.name: n for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        if node.name in dropped:
            env[node] = env[by_name[dropped[node.name]]]
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.eliminate_dead_code(is_impure_node=lambda n: impure(n, gm))
    out = graph_module(gm, graph, class_name=type(gm).__name__)
    out.meta = dict(gm.meta)
    return out
