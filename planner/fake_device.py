"""Run a graph traced on ``meta`` as fake tensors of another device (CPU by default).

A model built on ``meta`` is traced with ``device=meta`` baked into some nodes (``torch.arange(...,
device=meta)``, export's ``_assert_tensor_metadata``). Annotation runs the graph as fake CPU tensors,
because FLOPs counted on ``meta`` are wrong for attention (meta takes the math path), so such
constants are rewritten on the fly: top-level arguments by :func:`fix_device`, and the bodies of
higher-order ops (export's ``wrap_with_set_grad_enabled``) by :func:`with_device`, which returns a
copy and leaves the captured graph as traced.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["fix_device", "with_device"]


def fix_device(a: Any, device: torch.device) -> Any:
    """``a`` with a meta device (object or string) replaced by ``device``."""
    if isinstance(a, torch.device) and a.type == "meta":
        return device
    if isinstance(a, str) and a == "meta":
        return str(device)
    return a


def _map(a: Any, device: torch.device) -> Any:
    if isinstance(a, (tuple, list)):
        return type(a)(_map(x, device) for x in a)
    if isinstance(a, dict):
        return {k: _map(v, device) for k, v in a.items()}
    return a if isinstance(a, torch.fx.Node) else fix_device(a, device)


def with_device(gm: torch.fx.GraphModule, device: torch.device) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose node arguments say ``device`` where they said meta."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        node.args = _map(node.args, device)
        node.kwargs = _map(node.kwargs, device)
    copy = torch.fx.GraphModule(gm, graph)
    copy.recompile()
    return copy
