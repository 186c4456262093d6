"""Small helpers shared by the passes."""

from __future__ import annotations

import copy
from typing import Iterable

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["clone_graph_module", "local_fake"]


def clone_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule with a deep copy of ``gm``'s graph (node.meta copied) that shares its
    parameters, buffers and submodules. Passes rewrite the clone and leave their input intact, so
    one captured graph can be compiled for many plans and ranks."""
    out = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    out.meta = copy.copy(gm.meta)
    return out


def local_fake(v: torch.Tensor, shape: Iterable[int]) -> torch.Tensor:
    """A tensor like ``v`` (a node's ``meta["val"]``) with another shape: a fake tensor of ``v``'s
    fake mode, or a meta tensor; ``v`` itself when the shape is unchanged. Passes that slice a
    value use it to keep ``val`` rank-local."""
    shape = tuple(shape)
    if tuple(v.shape) == shape:
        return v
    mode = getattr(v, "fake_mode", None)
    if mode is not None:
        if all(type(d) is int for d in shape):  # static: wrap a meta tensor as the mode wraps its outputs
            return FakeTensor(mode, torch.empty(shape, dtype=v.dtype, device="meta"), v.device)  # 8x cheaper
        with mode:
            return torch.empty(shape, dtype=v.dtype, device=v.device)
    return torch.empty(shape, dtype=v.dtype, device="meta")
