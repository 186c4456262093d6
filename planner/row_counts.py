"""Does the loss divide by a count of the batch's values? Found on the captured graph, no run.

A loss that is not one of the forms the runtime weighs by pieces (``passes.loss_weights``: a
token mean, a sum, a sum over a function of a count) is combined as the plain mean of its pieces'
losses, which is the batch's loss only when each row's terms depend on that row alone. The eager
check (``fairscale.loss_check``) compares the batch with its pieces on the example batch, but a
number computed from the whole batch's values, such as the count of a padding mask, is the same in
every piece of an unpadded example batch: ``(l * m).sum() / n + 0.1 * (l * m).pow(2).sum() / n``
with ``n = m.sum()``, or ``losses[mask].mean()``, passed it and trained to other numbers on the
first padded batch. :func:`batch_count_problem` finds such a number in the graph:

* a 0-dim value computed from batch inputs alone (no parameter, buffer or constant of the model)
  by a reduction of a batch input's values, that the loss reads;
* a mean over a selection whose size depends on the data (``x[mask].mean()``).
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.fx.operator_schemas import normalize_function

from planner.batch_stats import source_line
from planner.graph import META_MODULE, ancestors
from planner.plan import KEEP_BATCH_WHOLE

__all__ = ["batch_counts", "batch_count_problem"]

aten = torch.ops.aten

_MEANS = {aten.mean.default, aten.mean.dim, aten.mse_loss.default, aten.l1_loss.default,
          aten.smooth_l1_loss.default, aten.huber_loss.default, aten.binary_cross_entropy.default,
          aten.binary_cross_entropy_with_logits.default, aten.cross_entropy_loss.default, aten.nll_loss.default,
          aten.nll_loss_nd.default, aten.soft_margin_loss.default, aten.kl_div.default}
"""Ops that average over their input's elements (a loss op with its default reduction, mean)."""


def batch_counts(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes of ``gm`` the loss reads that are counts of the batch's values (module docstring),
    in graph order."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    read = set(ancestors(out))
    batch_only: dict[torch.fx.Node, bool] = {}
    found = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            batch_only[node] = isinstance(val, torch.Tensor) and val.dim() > 0
            continue
        inputs = node.all_input_nodes
        batch_only[node] = node.op == "call_function" and bool(inputs) and all(
            batch_only.get(i, False) or _constant(i, batch_only) for i in inputs) and any(batch_only.get(i) for i in inputs)
        if node not in read or node.op != "call_function":
            continue
        val = node.meta.get("val")
        if batch_only[node] and _zero_dim(val) and any(_dims(i) for i in inputs):
            found.append(node)
        elif node.target in _MEANS and _selected(node) and _reduces_to_mean(node):
            found.append(node)
    return found


def batch_count_problem(gm: torch.fx.GraphModule) -> str | None:
    """Why a plan that cuts the batch cannot combine the pieces' losses of ``gm`` as their plain
    mean: the first of :func:`batch_counts`, with its module, op and source line; or None."""
    found = batch_counts(gm)
    if not found:
        return None
    node = found[0]
    if node.target in _MEANS and _selected(node):
        what = (f"a mean ({_site(node)}) over a selection whose size depends on the data, made at "
                f"{_site(_selection(node))}")
    else:
        what = f"a number computed from the whole batch's values (a count of a mask, a sum of lengths), at {_site(node)}"
    return (f"the loss is not computed row by row: it uses {what}. Cut into pieces (dp x "
            "microbatches), each piece computes it from its own rows and the plain mean of the pieces' losses is "
            "not the batch's loss whenever the pieces count differently (padded batches), which depends on the data, "
            "not only on this example batch. Return the loss as one sum divided by the count "
            "((l * mask).sum() / mask.sum(), which is weighed by the pieces' counts), or a token mean "
            f"(cross_entropy with ignore_index), or use a plan that keeps the batch whole ({KEEP_BATCH_WHOLE})")


def _site(node: torch.fx.Node) -> str:
    line = source_line(node)
    return f"module {node.meta.get(META_MODULE) or '<model top level>'}, op {node.target}" + (
        f", source {line}" if line else "")


def _selection(node: torch.fx.Node) -> torch.fx.Node:
    """The op that made the data-sized input of ``node`` (:func:`_selected`): the first ancestor
    along its first inputs whose own inputs are not data-sized (``x[mask]``'s ``aten.index``)."""
    while True:
        first = node.args[0] if node.args else None
        if not isinstance(first, torch.fx.Node) or not _data_sized(first):
            return node
        node = first


def _data_sized(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and bool(free_unbacked_symbols(val.shape))


def _constant(node: torch.fx.Node, batch_only: dict[torch.fx.Node, bool]) -> bool:
    """A value the batch does not give and the model does not hold: an op on no input (``ones``)."""
    return node.op == "call_function" and not node.all_input_nodes and not batch_only.get(node, False)


def _zero_dim(val: object) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _dims(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() > 0


def _selected(node: torch.fx.Node) -> bool:
    """Whether ``node``'s first input has a size that depends on the data (``x[mask]``)."""
    first = node.args[0] if node.args else None
    return isinstance(first, torch.fx.Node) and _data_sized(first)


def _reduces_to_mean(node: torch.fx.Node) -> bool:
    """A mean op, or a loss op left at its default reduction (mean)."""
    if node.target in (aten.mean.default, aten.mean.dim):
        return True
    assert callable(node.target)
    norm = normalize_function(node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True)
    return norm is not None and norm.kwargs.get("reduction", 1) == 1
