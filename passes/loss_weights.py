"""Token-mean losses cut into microbatches: how much each microbatch weighs in the step's loss.

A loss that is the mean of per-token terms over the tokens whose label is not ``ignore_index``
(``cross_entropy(logits, labels)`` with ``reduction="mean"``, as Hugging Face's ``ForCausalLMLoss``
and ``ForMaskedLMLoss`` compute it without ``num_items_in_batch``) is ``S / n`` over the batch it
sees: ``S`` the sum of the terms, ``n`` the number of labels not ignored. A step cut into dp slices
and microbatches computes ``l_i = S_i / n_i`` on each piece; the step's loss is
``sum(S_i) / N = sum(l_i * n_i / N)`` (``N = sum(n_i)``), which is the plain mean of the ``l_i``
only when every ``n_i`` is the same. Masked-LM labels (``-100`` at the positions not masked) and
padded batches make them differ, and the plain mean is then silently wrong.

:func:`token_counter` recognizes such a loss in a captured graph: the graph's output is, through
casts and views, a mean ``cross_entropy_loss`` / ``nll_loss`` without class weights, whose labels
are computed from batch inputs alone (Hugging Face's shift: pad with ``-100``, slice, view). It
returns a :class:`TokenCounter`, a small graph of the labels' ops that counts a piece's labels
not ignored; the runtime (``fairscale.runtime.engine`` and ``pipeline``) weighs each
microbatch's loss by ``dp * n_i / N`` instead of ``1 / microbatches`` (dp averages gradients over
its ranks). Any other loss (no such node, class weights, labels that depend on parameters) gets ``None``
and the plain mean, which is exact for losses that are means over the rows of the batch.

A token mean INSIDE a larger loss (``ce + 0.01 * aux``, a sum of two token means) cannot be
reweighted by pieces: the other terms have their own weights. Its counter is returned with
``exact=False``; the runtime then checks every step that the pieces count the same number of
labels (the plain mean is exact then) and otherwise raises, on every rank alike (each holds the
global batch), before the step computes a gradient. Never silently different.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from passes.loss_count import TokenCounter

__all__ = ["TokenCounter", "token_counter"]

aten = torch.ops.aten

_TOKEN_MEAN = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default,
               aten.nll_loss_forward.default}
_PASS_THROUGH = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
                 aten.alias.default, aten.view.default, aten.reshape.default, aten.squeeze.default,
                 aten.contiguous.default, aten.detach.default}
"""Ops between the loss node and the graph's output that keep the loss's value."""
_MEAN = 1
"""``torch.nn._reduction``'s enum for ``reduction="mean"``."""


def token_counter(gm: torch.fx.GraphModule) -> TokenCounter | None:
    """The counter of ``gm``'s loss if it is a token mean or contains one (module docstring), else None."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    value = out.args[0]
    while isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.fx.Node):
        return None
    while value.op == "call_function" and value.target in _PASS_THROUGH:
        value = value.args[0]
    if value.op == "call_function" and value.target in _TOKEN_MEAN:
        found = _labels_of(value)
        if found is not None:
            return _build(gm, [found], loss=str(value.target), exact=True)
    inner = [(n, found) for n in gm.graph.nodes if n.op == "call_function" and n.target in _TOKEN_MEAN
             for found in [_labels_of(n)] if found is not None]
    if not inner:
        return None
    return _build(gm, [found for _, found in inner], loss=", ".join(str(n.target) for n, _ in inner), exact=False)


_Labels = tuple[torch.fx.Node, int, set[torch.fx.Node]]
"""A token mean's labels node, its ignore_index, and the nodes the labels are computed from."""


def _labels_of(value: torch.fx.Node) -> _Labels | None:
    """The labels of the mean token loss ``value``; None for another reduction, class weights, or
    labels that are not a function of the batch alone."""
    assert callable(value.target)
    norm = normalize_function(value.target, tuple(value.args), dict(value.kwargs), normalize_to_only_use_kwargs=True)
    kwargs = norm.kwargs if norm is not None else {}
    if kwargs.get("weight") is not None or kwargs.get("reduction", _MEAN) != _MEAN:
        return None
    target = kwargs.get("target")
    if not isinstance(target, torch.fx.Node):
        return None
    seen: set[torch.fx.Node] = set()
    stack = [target]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op not in ("placeholder", "call_function"):
            return None  # labels computed from parameters or buffers: not a function of the batch
        stack.extend(node.all_input_nodes)
    return target, int(kwargs.get("ignore_index", -100)), seen


def _build(gm: torch.fx.GraphModule, labels: list[_Labels], *, loss: str, exact: bool) -> TokenCounter:
    """A counter graph: the ops ``labels`` are computed with, then each one's count of labels kept
    (one int64 scalar, or a vector of one count per token mean when there are several)."""
    seen = set().union(*(ancestors for _, _, ancestors in labels))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs = []
    for node in gm.graph.nodes:
        if node in seen:
            env[node] = graph.node_copy(node, lambda x: env[x])
            if node.op == "placeholder":
                inputs.append(placeholders.index(node))
    counts = [graph.call_function(aten.sum.default, (graph.call_function(aten.ne.Scalar, (env[t], ignore)),))
              for t, ignore, _ in labels]
    graph.output(counts[0] if len(counts) == 1 else graph.call_function(aten.stack.default, (counts,)))
    return TokenCounter(gm=torch.fx.GraphModule(torch.nn.Module(), graph), batch_inputs=inputs,
                        ignore_index=labels[0][1], loss=loss, exact=exact)
