"""GraphModules whose Python code is generated when it is first needed, not when they are built.

Planning builds many GraphModules that are read but never run: the search's capture, its ATen
copy, the functional copy, and 128 stage modules of which the compile check compiles one per
class. ``torch.fx.GraphModule`` generates and compiles Python code for its graph on construction
and on every ``recompile()`` (about a second for a 128-block graph); torch's ``_LazyGraphModule``
(what TorchInductor uses for its pattern graphs) defers that to the first call, or to the first
read of ``.code``. Everything else (parameters, ``graph``, ``meta``, deepcopy, pickling) is the
GraphModule's own. Where torch lacks it, these are plain GraphModules.
"""

from __future__ import annotations

import torch
import torch.fx

__all__ = ["graph_module"]

try:
    from torch.fx._lazy_graph_module import _LazyGraphModule as _Lazy
except ImportError:  # pragma: no cover - an older or newer torch without it: build eagerly
    _Lazy = torch.fx.GraphModule  # type: ignore[misc,assignment]


def graph_module(root: torch.nn.Module | dict[str, object], graph: torch.fx.Graph,
                 class_name: str = "GraphModule") -> torch.fx.GraphModule:
    """``torch.fx.GraphModule(root, graph, class_name)``, with its code generated when first run.
    ``recompile()`` on it (after editing its graph) is deferred the same way."""
    return _Lazy(root, graph, class_name=class_name)
