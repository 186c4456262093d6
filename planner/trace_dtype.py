"""Trace a model as it computes under a mixed-precision plan: parameters and inputs in that dtype.

A bf16 (fp16) plan runs the model with bf16 copies of its fp32 parameters and casts its floating
inputs (``passes.dp.graph.cast_io``). Code that depends on the dtype then takes other paths than
in fp32: Hugging Face's RMSNorm upcasts with ``hidden_states.to(torch.float32)`` and casts back with
``.to(input_dtype)``, rotary embeddings cast cos/sin ``.to(x.dtype)``, Meta's llama writes
``self._norm(x.float()).type_as(x)``. Traced in fp32 those are no-ops and vanish, so a bf16 run of
an fp32 trace computes the norm's variance in bf16, or mixes fp32 values into bf16 matmuls. The
graph a rank compiles for such a plan is therefore traced (torch.export) with every floating
parameter and input cast to the plan's dtype, the upcasts becoming real casts, and then given the
model's own parameters back: the data-parallel pass keeps those as fp32 master weights and casts
them per use to the dtype the trace expects. Buffers keep their dtype, as the runtime keeps them.

Usage::

    with in_dtype(model, torch.bfloat16, batch) as (cast_batch, restore):
        gm = export_trace(LossModule(model, loss_fn), cast_batch)
    restore(gm)                      # gm's parameter attributes are the model's own again
    traced_dtype(gm)                 # torch.bfloat16: what the pass checks before casting
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch import nn

__all__ = ["in_dtype", "traced_dtype", "META_TRACE_DTYPE"]

META_TRACE_DTYPE = "fs_trace_dtype"
"""node.meta: the dtype :func:`in_dtype` traced the model in, on every node of the trace (a stage
cut copies its nodes' meta, so a stage that reads no parameter still says how it was traced)."""


def _swap(model: nn.Module, make: Callable[[nn.Parameter], nn.Parameter]) -> list[tuple[nn.Module, str, Any]]:
    """Replace every floating parameter slot of ``model`` by ``make(param)`` (one new parameter per
    tied tensor); returns what to put back."""
    made: dict[int, nn.Parameter] = {}
    undo = []
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point():
                continue
            if id(p) not in made:
                made[id(p)] = make(p)
            undo.append((module, name, p))
            module._parameters[name] = made[id(p)]
    return undo


@contextlib.contextmanager
def in_dtype(model: nn.Module, dtype: torch.dtype, batch: tuple[Any, ...], *, values: bool = False
             ) -> Iterator[tuple[tuple[Any, ...], Callable[[torch.fx.GraphModule], None]]]:
    """While inside: ``model``'s floating parameters are ``dtype`` stand-ins of their shapes
    (``torch.empty_like``: the trace reads shapes and dtypes, never values, so no page of them is
    touched; with ``values``, copies cast to ``dtype``, for a graph run on the example batch, as
    annotation runs an op whose output size depends on the data, MoE routing); yields the batch
    with its floating tensors cast and ``restore(gm)``, which points a
    traced graph's parameter attributes back at the model's own (the graph shares them, as an
    fp32 capture does) and marks its nodes with ``dtype`` (:data:`META_TRACE_DTYPE`); the graph's
    recorded values keep the dtype (:func:`traced_dtype`)."""
    copies: dict[int, nn.Parameter] = {}

    def make(p: nn.Parameter) -> nn.Parameter:
        stand_in = p.detach().to(dtype) if values else torch.empty_like(p, dtype=dtype)
        copy = nn.Parameter(stand_in, requires_grad=p.requires_grad)
        copies[id(copy)] = p
        return copy

    cast = tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in batch)
    undo = _swap(model, make)

    def restore(gm: torch.fx.GraphModule) -> None:
        for module in gm.modules():
            graph = getattr(module, "graph", None)
            if isinstance(graph, torch.fx.Graph):
                for node in graph.nodes:
                    node.meta[META_TRACE_DTYPE] = dtype
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) in copies:
                    module._parameters[name] = copies[id(p)]

    try:
        yield cast, restore
    finally:
        for module, name, p in undo:
            module._parameters[name] = p


def traced_dtype(gm: torch.nn.Module) -> torch.dtype | None:
    """The dtype ``gm``'s floating parameters had when it was traced: the dtype :func:`in_dtype`
    marked its nodes with, else (a trace of the model as it is) that of the first parameter read
    (``get_attr``) whose recorded value is floating, in graph order; None without either. A graph
    cut into stages or rewritten by the passes keeps its nodes' meta, so every piece of a trace
    says how it was traced, a stage that reads no parameter (a weightless norm's upcast) too."""
    graphs: list[tuple[nn.Module, torch.fx.Graph]] = [
        (m, g) for m in gm.modules() if isinstance(g := getattr(m, "graph", None), torch.fx.Graph)]
    marked = next((n.meta[META_TRACE_DTYPE] for _, g in graphs for n in g.nodes if META_TRACE_DTYPE in n.meta), None)
    if marked is not None:
        return marked
    for module, graph in graphs:
        for node in graph.nodes:
            val = node.meta.get("val")
            if node.op != "get_attr" or not (isinstance(val, torch.Tensor) and val.is_floating_point()):
                continue
            try:
                module.get_parameter(str(node.target))  # a buffer or constant says nothing
            except AttributeError:
                continue
            return val.dtype
    return None
