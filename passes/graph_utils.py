"""Small helpers shared by the passes."""

from __future__ import annotations

import copy

import torch.fx

__all__ = ["clone_graph_module"]


def clone_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule with a deep copy of ``gm``'s graph (node.meta copied) that shares its
    parameters, buffers and submodules. Passes rewrite the clone and leave their input intact, so
    one captured graph can be compiled for many plans and ranks."""
    out = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    out.meta = copy.copy(gm.meta)
    return out
