"""Small helpers shared by the passes."""

from __future__ import annotations

import copy
import functools
import weakref
from typing import Callable, Iterable

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["clone_graph_module", "local_fake", "per_graph"]


def clone_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule with a deep copy of ``gm``'s graph (node.meta copied) that shares its
    parameters, buffers and submodules. Passes rewrite the clone and leave their input intact, so
    one captured graph can be compiled for many plans and ranks."""
    out = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    out.meta = copy.copy(gm.meta)
    return out


def per_graph(fn: Callable[[torch.fx.GraphModule], torch.fx.GraphModule]) \
        -> Callable[[torch.fx.GraphModule], torch.fx.GraphModule]:
    """``fn`` (a pass that returns a new GraphModule, or its input unchanged) computed once per
    GraphModule and kept while that lives; again when the module's graph has been replaced or has
    gained or lost nodes. A result that is the input itself is not kept (a value holding its own
    weak key would never be collected); ``fn`` then runs again, which for such passes is one scan.
    Callers share the result and must not change it."""
    done: weakref.WeakKeyDictionary[torch.fx.GraphModule, tuple[int, int, torch.fx.GraphModule]] = \
        weakref.WeakKeyDictionary()

    @functools.wraps(fn)
    def cached(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        found = done.get(gm)
        if found is not None and found[:2] == (id(gm.graph), len(gm.graph.nodes)):
            return found[2]
        out = fn(gm)
        if out is not gm:
            done[gm] = (id(gm.graph), len(gm.graph.nodes), out)
        return out
    return cached


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
