"""The ops a tensor-parallel rank runs whole: layer norms and elementwise ops on unsplit activations.

Under tp a block's matmuls and attention are split, but its layer norms and residual adds run on
the full activations on every rank (Megatron-LM without sequence parallelism). The planning rate
(``Cluster.peak_flops``) is fitted to a whole block, so these ops' time sits in it per FLOP and the
cost model's ``flops / tp`` divided it by tp; on CPU ranks they are a large part of a tp rank's block
(measured with 8 ranks on 2 cores: two layer norms and two adds of 1 MB, 1.7 ms of a 16 ms block).
Calibration times a layer norm's and an add's forward+backward per byte of output
(``Cluster.whole_op_s``: the slope between two sizes, so the per-op host cost, charged apart as
``op_overhead_s``, is left out); a split layer is charged the ``1 - 1/tp`` of those seconds that
the division took away. Without measured costs (GPUs) nothing is added.

Usage::

    from planner.cost_whole import whole_op_bytes, whole_op_seconds
    per_layer = whole_op_bytes(graph, split)           # layer -> (norm bytes, elementwise bytes)
    extra = whole_op_seconds(per_layer["layers.0"], cluster.whole_op_s, tp=8)
"""

from __future__ import annotations

from typing import Any

from planner.cluster import WHOLE_OP_KINDS
from planner.graph import META_LAYER, META_VAL, ModelGraph

__all__ = ["whole_op_bytes", "whole_op_seconds", "op_kind", "NORM", "ELEMENTWISE"]

NORM, ELEMENTWISE = WHOLE_OP_KINDS
"""The kinds of whole op calibration times (``Cluster.whole_op_s`` keys)."""

_NORMS = ("layer_norm", "rms_norm", "group_norm", "batch_norm")
_KINDS: dict[Any, str | None] = {}


def op_kind(target: Any) -> str | None:
    """``NORM`` for a normalization op, ``ELEMENTWISE`` for an op torch tags pointwise, else None
    (matmuls, attention, views, reductions: not counted here)."""
    if target not in _KINDS:
        name = str(target)
        if any(n in name for n in _NORMS):
            _KINDS[target] = NORM
        else:
            import torch  # the tags of aten ops; planner modules import torch lazily where they can

            tags = getattr(target, "tags", ())
            _KINDS[target] = ELEMENTWISE if torch.Tag.pointwise in tags else None
    return _KINDS[target]


def whole_op_bytes(graph: ModelGraph, split: set[str]) -> dict[str, tuple[float, float]]:
    """Layer -> (bytes of normalization outputs, bytes of elementwise outputs) of the captured batch
    whose nodes tensor parallelism leaves whole (not in ``split``,
    ``planner.cost_memory.tp_split_nodes``). Layers without such ops are left out."""
    out: dict[str, tuple[float, float]] = {}
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or node.name in split or META_LAYER not in node.meta:
            continue
        kind = op_kind(node.target)
        val = node.meta.get(META_VAL)
        if kind is None or isinstance(val, (tuple, list)) and not val:
            continue
        first = val[0] if isinstance(val, (tuple, list)) else val  # a layer norm's output, before its statistics
        nbytes = float(first.numel() * first.element_size()) if hasattr(first, "numel") else 0.0
        norm, elem = out.get(node.meta[META_LAYER], (0.0, 0.0))
        out[node.meta[META_LAYER]] = (norm + nbytes, elem) if kind == NORM else (norm, elem + nbytes)
    return out


def whole_op_seconds(whole: tuple[float, float], costs: dict[str, float], tp: int) -> float:
    """Seconds (forward + backward) a tp rank's whole ops take beyond what ``flops / tp`` charged
    them: ``(1 - 1/tp) · (norm bytes · costs[NORM] + elementwise bytes · costs[ELEMENTWISE])`` for
    ``whole`` bytes of one microbatch. Example: 2 MB of layer norms at 0.5 ns/B and 2 MB of adds
    at 0.25 ns/B, tp 4: 0.75 · (1 + 0.5) ms = 1.125 ms."""
    if tp <= 1 or not costs:
        return 0.0
    norm, elem = whole
    return (1 - 1 / tp) * (norm * costs.get(NORM, 0.0) + elem * costs.get(ELEMENTWISE, 0.0))
