"""Which nodes of a repeated block are exact copies of an earlier block, so their facts can be copied.

A 96-layer GPT has 95 blocks whose nodes do what block 1's nodes do, on inputs of the same shapes.
:func:`replica_map` pairs every node of block k >= 2 with the node at the same position in block 1
(the template; block 0 is not used because it also runs the glue that joins the next layer), after
checking, node by node, that the op, the constant arguments and the wiring agree:

    an input inside the block       -> the same position in the template
    a parameter (get_attr)          -> a parameter of the same shape and dtype
    the same outside node           -> shared glue (the attention mask, rotary cos/sin, placeholders)
    another layer's node            -> the node at the same distance back, at the same position
                                       counted from the end of its layer (the previous block's output)

Blocks that differ anywhere are annotated normally. Annotation then costs O(distinct blocks) fake
tensor work plus O(nodes) dictionary work (see ``planner.annotate``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from planner.graph import META_LAYER, Layer

__all__ = ["replica_map"]


def replica_map(gm: torch.fx.GraphModule, layers: list[Layer], blocks: dict[str, list[str]]) -> dict[str, str]:
    """Replica node name -> template node name, for the blocks that match their template exactly."""
    nodes = {n.name: n for n in gm.graph.nodes}
    by_name = {layer.name: layer for layer in layers}
    position = {}
    for layer in layers:
        count = len(layer.nodes)
        for i, name in enumerate(layer.nodes):
            position[name] = (layer.index, count - i)
    out: dict[str, str] = {}
    _SPECS.clear()
    for members in blocks.values():
        if len(members) < 3:
            continue
        template = by_name[members[1]]
        for member in members[2:]:
            replica = by_name[member]
            pairs = _match(nodes, template, replica, position)
            if pairs is not None:
                out.update(pairs)
    _SPECS.clear()
    return out


def _match(nodes: dict[str, torch.fx.Node], template: Layer, replica: Layer,
           position: dict[str, tuple[int, int]]) -> dict[str, str] | None:
    if len(template.nodes) != len(replica.nodes):
        return None
    local_t = {name: i for i, name in enumerate(template.nodes)}
    local_r = {name: i for i, name in enumerate(replica.nodes)}
    shift = replica.index - template.index
    for name_t, name_r in zip(template.nodes, replica.nodes):
        t, r = nodes[name_t], nodes[name_r]
        if t.op != r.op or t.target != r.target:
            return None
        if not _same_args((t.args, t.kwargs), (r.args, r.kwargs), local_t, local_r, position, shift):
            return None
    return dict(zip(replica.nodes, template.nodes))


def _same_args(a: Any, b: Any, local_t: dict[str, int], local_r: dict[str, int],
               position: dict[str, tuple[int, int]], shift: int) -> bool:
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
            return False
        if a.name in local_t or b.name in local_r:
            return local_t.get(a.name, -1) == local_r.get(b.name, -2)
        if a is b:
            return True
        if a.op == "get_attr" and b.op == "get_attr":
            va, vb = _attr_spec(a), _attr_spec(b)
            return va is not None and va == vb
        pa, pb = position.get(a.name), position.get(b.name)
        return (pa is not None and pb is not None and pb[0] - pa[0] == shift and pa[1] == pb[1]
                and a.meta.get(META_LAYER) is not None)
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same_args(x, y, local_t, local_r, position, shift) for x, y in zip(a, b)))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(_same_args(a[k], b[k], local_t, local_r, position, shift) for k in a))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # noqa: BLE001 - incomparable constants: not a replica
        return False


_SPECS: dict[torch.fx.Node, tuple[Any, ...] | None] = {}


def _attr_spec(node: torch.fx.Node) -> tuple[Any, ...] | None:
    if node not in _SPECS:
        _SPECS[node] = _read_spec(node)
    return _SPECS[node]


def _read_spec(node: torch.fx.Node) -> tuple[Any, ...] | None:
    """(shape, dtype, requires_grad) of the tensor a get_attr node reads."""
    obj: Any = node.graph.owning_module
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, torch.Tensor):
        return None
    return tuple(obj.shape), obj.dtype, obj.requires_grad
