"""Activation recompute as a graph pass: wrap the plan's layers in non-reentrant checkpointing.

Tracing runs through ``torch.utils.checkpoint`` and loses it, so recompute is applied after
capture. For each layer that ``plan.recompute`` selects, the pass fuses the layer's activation
nodes into a submodule ``recompute_<layer>`` and calls it through :func:`recompute_call`::

    before:  x1 = linear(x, w_q) ... y = add(x, o)            (all saved for backward)
    after:   y = recompute_call(recompute_layers_0, "full", x, w_q, ...)   (only x, w_q kept)

The region holds the layer's nodes that depend on an activation. Nodes that depend only on
parameters and constants (get_attr, an FSDP all-gather of a unit, a dtype cast of a weight) stay
outside and enter as inputs, so the pass composes with the data-parallel pass in either order and
never repeats a parameter gather in backward. Collectives on activations (tensor-parallel
all-reduces) stay inside and are repeated in backward, as in Megatron-LM's full recompute.

Kinds:
    full        save only the region's inputs; recompute everything in backward.
    selective   save the outputs of matmuls and attention (expensive to recompute), recompute the
                cheap elementwise ops around them (Korthikanti et al. 2022, section 5).
    none        leave the layer as it is.

node.meta read: ``fs_layer`` (capture). Written: ``fs_recompute`` = kind, on the fused call node.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from passes.graph_utils import clone_graph_module
from passes.ops.recompute_ops import RETAIN_LISTENERS, recompute_call
from planner.graph import META_LAYER
from planner.plan import Plan

__all__ = ["insert_recompute_pass", "recompute_call", "layers_to_recompute", "META_RECOMPUTE", "RETAIN_LISTENERS"]

META_RECOMPUTE = "fs_recompute"

def layers_to_recompute(plan: Plan, layer_names: list[str]) -> dict[str, str]:
    """Layer -> kind for every layer the plan's recompute selectors match (later rules win)."""
    from planner.selectors import parse_selector

    out: dict[str, str] = {}
    for selector, kind in plan.recompute.items():
        for name in parse_selector(selector).select(layer_names):
            out[name] = kind
    return {k: v for k, v in out.items() if v != "none"}


def insert_recompute_pass(gm: torch.fx.GraphModule, plan: Plan) -> torch.fx.GraphModule:
    """Wrap every layer ``plan.recompute`` selects in checkpointing; returns a rewritten copy
    (parameters shared), or ``gm`` itself when nothing is selected."""
    names = list(dict.fromkeys(n.meta[META_LAYER] for n in gm.graph.nodes if META_LAYER in n.meta))
    todo = layers_to_recompute(plan, names)
    if not todo:
        return gm
    gm = clone_graph_module(gm)
    depends = _activation_dependent(gm)
    partitions, kinds = [], []
    for layer in names:
        if layer not in todo:
            continue
        region: dict[torch.fx.Node, int | None] = {n: None for n in gm.graph.nodes
                  if n.op == "call_function" and n.meta.get(META_LAYER) == layer and n in depends}
        if region:
            partitions.append(region)
            kinds.append((layer, todo[layer]))
    fused = fuse_by_partitions(gm, partitions, prefix="recompute_")
    calls = [n for n in fused.graph.nodes if n.op == "call_module" and str(n.target).startswith("recompute_")]
    if len(calls) != len(kinds):
        raise RuntimeError(f"recompute: fused {len(calls)} regions for {len(kinds)} layers")
    # fuse_by_partitions names modules in partition order; rename them after their layers.
    for node, (layer, kind) in zip(sorted(calls, key=lambda n: int(str(n.target).rpartition("_")[2])), kinds):
        attr = "recompute_" + layer.replace(".", "_")
        fused.add_submodule(attr, fused.get_submodule(str(node.target)))
        fused.delete_submodule(str(node.target))
        with fused.graph.inserting_before(node):
            getter = fused.graph.get_attr(attr)
            call = fused.graph.call_function(recompute_call, (getter, kind, *node.args))
        call.meta.update(node.meta)
        call.meta[META_LAYER] = layer
        call.meta[META_RECOMPUTE] = kind
        node.replace_all_uses_with(call)
        fused.graph.erase_node(node)
    fused.graph.lint()
    fused.recompile()
    fused.meta.update(gm.meta)
    return fused


def _activation_dependent(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Nodes whose value depends on a placeholder (an activation), not only on parameters."""
    out: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out
