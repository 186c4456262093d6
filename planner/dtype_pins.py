"""Where a model's code pins values to float32: what an fp32 trace of it cannot run in bf16.

The planning capture runs the model in fp32. There, a ``.to(torch.float32)``, ``.float()`` or
``.to(x.dtype)`` is a no-op that leaves only export's ``_assert_tensor_metadata(dtype=torch.float32)``
in the graph, and a cast from integers (``position_ids.float()``) is a real cast to fp32. Run with
bf16 parameters such a graph would compute Hugging Face's RMSNorm variance in bf16 where the model
computes it in fp32, or mix fp32 values into bf16 matmuls. So the graphs ranks compile for a bf16
or fp16 plan are traced in that dtype (:mod:`planner.trace_dtype`), and the mixed-precision pass
(``passes.dp.graph.cast_io``) refuses a graph traced in fp32 that has pins, naming their lines.

Usage::

    pins = fp32_pins(graph)     # ["hidden_states.to(torch.float32) (modeling_llama.py:62 `...`)", ...]
"""

from __future__ import annotations

import torch
import torch.fx

from planner.batch_stats import source_line
from planner.graph import ModelGraph

__all__ = ["fp32_pins", "module_pins", "pins_problem"]

_ASSERT = "aten._assert_tensor_metadata.default"
_CASTS = {"aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout"}


def _pinned(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = str(node.target)
    dtype = node.kwargs.get("dtype", node.args[1] if target == "aten.to.dtype" and len(node.args) > 1 else None)
    return dtype is torch.float32 and (target == _ASSERT or target in _CASTS)


def fp32_pins(graph: ModelGraph) -> list[str]:
    """One ``node (file:line `code`)`` per place the captured code converts to (or checks for)
    float32, nested graphs (autocast regions) included; empty for a model that never does."""
    return module_pins(graph.gm)


def module_pins(gm: torch.nn.Module) -> list[str]:
    """:func:`fp32_pins` of a graph module (a pass's view of the capture)."""
    found = []
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                if _pinned(node):
                    site = source_line(node)
                    found.append(f"{node.name}{f' ({site})' if site else ''}")
    return found


def pins_problem(pins: list[str], dtype: str, path: str) -> str:
    """The refusal of a ``dtype`` (bf16 / fp16) plan, at JSON ``path``, of an fp32 trace with ``pins``."""
    shown = "; ".join(pins[:3]) + (f"; and {len(pins) - 3} more" if len(pins) > 3 else "")
    return (f'{path}: "{dtype}" would not compute what this model computes in {dtype}: its code converts values '
            f"to float32 ({shown}), which the fp32 capture records as no-ops or as fp32 values mixed into "
            f'{dtype} matmuls; trace it in {dtype} (planner.capture.capture(..., dtype=), as '
            f'fairscale.parallelize\'s ranks do) or plan with "fp32"')
