"""What annotation says when a node cannot run on fake tensors, and the example batch's real
values it reads for ops whose output size depends on the data (:mod:`planner.annotate`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from planner.capture_errors import DATA_DEPENDENT_ADVICE, is_data_dependent, node_site, source_context
from planner.fx_capture import failure_site
from planner.graph import META_MODULE

__all__ = ["AnnotateError", "explain", "dynamic_shape", "example_values"]


def example_values(gm: torch.fx.GraphModule, inputs: tuple[Any, ...]) -> dict[str, Any]:
    """Every node's value when ``gm`` runs once on the real ``inputs`` without autograd, by node
    name; its buffers are restored afterwards (a training-mode batch norm would update its running
    statistics). Empty when the run fails (the caller then explains the op it could not annotate)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    seen: dict[str, Any] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            seen[n.name] = out = super().run_node(n)
            return out

    with unset_fake_temporarily(), torch.no_grad():
        buffers = {k: b.clone() for k, b in gm.named_buffers()}
        try:
            Recorder(gm).run(*inputs)
        except Exception:  # noqa: BLE001 - no real value then: the caller explains the op
            seen.clear()
        finally:
            for k, b in gm.named_buffers():
                b.copy_(buffers[k])
    return seen


def dynamic_shape(exc: BaseException) -> bool:
    """The op's output size depends on the data (nonzero, masked indexing), not a value read in
    Python (``.item()``, an ``if`` on a tensor): the first has a value on the example batch that
    the graph reproduces on every batch, the second would fix one branch."""
    chain: BaseException | None = exc
    while chain is not None:
        if type(chain).__name__ == "DynamicOutputShapeException":
            return True
        chain = chain.__cause__ or chain.__context__
    return False


class AnnotateError(RuntimeError):
    """A node could not run on fake tensors (its value depends on data, or an op has no fake kernel)."""


def explain(node: torch.fx.Node, exc: BaseException) -> str:
    """The user's line (from the traceback, else the stack trace export recorded on the node) with
    a few lines around it, what failed and what to do; the fx node only when no line is known."""
    site = failure_site(exc)
    where = (site[0], site[1]) if site is not None else node_site(node)
    what = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
    module = node.meta.get(META_MODULE)
    op = (str(node.target) if isinstance(node.target, (str, torch._ops.OpOverload))
          else getattr(node.target, "__name__", str(node.target)))
    in_what = (f" (op {op}" + (f" in module {module}" if module else " at the model's top level") + ")"
               if node.op in ("call_function", "call_method") else "")
    lines = [f"cannot compute the facts of {where[0]}:{where[1]}{in_what} on fake tensors (shapes only, no values):"
             if where is not None else f"cannot compute the facts of {node.format_node()}{in_what} on fake tensors:"]
    if where is not None:
        lines += source_context(*where)
    lines.append(f"  {what}")
    if is_data_dependent(exc):
        lines += ["The result or a branch there depends on the data, which the planner cannot see.", DATA_DEPENDENT_ADVICE]
    else:
        lines.append("The op has no fake-tensor kernel or rejects fake inputs; please report it with this message.")
    return "\n".join(lines)
