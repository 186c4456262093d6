"""What one pipeline stage's graph will hold, read off the captured graph before it is built.

``passes.split_stages`` decides per stage which nodes it computes (``keep``), which values it
receives and which it sends. A :class:`Blueprint` turns that into the exact node list the stage
graph gets, in its order, with the dead code already left out::

    bp = blueprint(gm, keep, recv, send, placeholders, position)
    bp.batch   # the flat batch's placeholders the stage reads: (index, node)
    bp.recv    # values received from the previous stage (placeholders of the stage graph)
    bp.attrs   # get_attr nodes, one per tensor (two names of one tensor share the first: bp.alias)
    bp.body    # the compute nodes that stay, in graph order
    bp.send    # values sent on (last stage: the loss)

The stage graph is then a copy of these nodes, nothing more; building it is the costly part (a
GraphModule, attribute copies), so the split builds a stage only when it is used
(``StageGraph.gm``), and everything else it records (parameter keys, shared weights, boundary
specs) and ``passes.stage_classes`` read the blueprint. A 1T GPT cut into 128 stages is compiled
at plan time from three of them.

Dead code: a node stays when the stage sends it, when it is impure (``planner.graph.impure``: what
``Node.is_impure`` keeps, in-place and random ops, and a no_grad block that writes a buffer), or when a node that stays
reads it; the same rule as the graph's dead-code elimination, which the builder runs afterwards
and which must then find nothing to remove (it raises if it does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from planner.modpath import fetch_attr
from planner.graph import impure

__all__ = ["Blueprint", "blueprint"]


@dataclass
class Blueprint:
    """The nodes of one stage graph, as nodes of the captured graph (module docstring)."""

    source: torch.fx.GraphModule
    """The graph the nodes belong to (what the get_attrs read)."""
    batch: list[tuple[int, Node]]
    recv: list[Node]
    attrs: list[Node]
    body: list[Node]
    send: list[Node]
    alias: dict[Node, Node] = field(default_factory=dict)
    """get_attr node -> the kept get_attr of the same tensor (itself for a kept one)."""
    values: dict[Node, Any] = field(default_factory=dict)
    """get_attr node -> the object it reads in ``source``."""

    def ref(self, node: Node) -> Node:
        """The node of the stage graph that stands for ``node`` (an alias: its kept get_attr)."""
        return self.alias.get(node, node)

    def nodes(self) -> list[Node]:
        """Placeholders (batch, then received), get_attrs, body: the stage graph's order."""
        return [ph for _, ph in self.batch] + self.recv + self.attrs + self.body


def blueprint(gm: torch.fx.GraphModule, keep: set[Node], recv: list[Node], send: list[Node],
              placeholders: list[Node], position: dict[Node, int]) -> Blueprint:
    """The :class:`Blueprint` of the stage that computes ``keep`` (module docstring)."""
    body = sorted(keep, key=position.__getitem__)
    reads = {i for node in body for i in node.all_input_nodes}
    batch = [(idx, ph) for idx, ph in enumerate(placeholders) if ph in reads]
    alias: dict[Node, Node] = {}
    values: dict[Node, Any] = {}
    first: dict[int, Node] = {}
    for node in sorted((i for i in reads if i.op == "get_attr"), key=position.__getitem__):
        values[node] = value = fetch_attr(gm, str(node.target))
        alias[node] = first.setdefault(id(value), node) if isinstance(value, torch.Tensor) else node
    live: set[Node] = set()
    stack = [alias.get(v, v) for v in send] + [n for n in body if impure(n)]
    while stack:
        node = stack.pop()
        if node in live or node not in keep and node.op != "get_attr":
            continue  # a placeholder, or a received value: an input of the stage
        live.add(node)
        stack.extend(alias.get(i, i) for i in node.all_input_nodes)
    attrs = [n for n, kept in alias.items() if kept is n and n in live]
    return Blueprint(source=gm, batch=batch, recv=list(recv), attrs=attrs, body=[n for n in body if n in live],
                     send=list(send), alias=alias, values=values)
