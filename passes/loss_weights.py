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
its ranks). A class-weighted token mean (``cross_entropy(..., weight=w)``) is ``S / W`` with ``W`` the sum of
the weights of the labels not ignored: the same reweighting, with ``n_i`` that sum (a float).
A loss that is a SUM over the batch (a loss op's ``reduction="sum"``, or ``reduction="none"``
then ``.sum()``) is the sum of its pieces' losses, not their mean: each piece weighs ``dp``
(``kind="sum"``; dp averages gradients over its ranks), where the plain mean made the step
``1 / (dp · microbatches)`` of it. Any other loss (no such node, labels that depend on parameters)
gets ``None`` and the plain mean, which is exact for losses that are means over the rows of the
batch (a custom ``.sum()`` over the rows is not recognized: the same silent factor). A sum divided
by the batch's rows, or by a multiple of them, on its way to the output (``reduction="batchmean"``,
of token logits flattened too; ``loss.sum() / x.size(0)``) is a mean over rows: a piece divides by
its own rows. A sum times or over another number (``0.5 * mse_sum``) is a sum. A loss divided or multiplied by a 0-dim batch
input (Hugging Face's ``num_items_in_batch``), which every piece gets whole, is read as the loss it
scales. A sum divided by a count the batch gives (``(l * mask).sum() / mask.sum()``), or by any
function of one (``.clamp(min=1)``, ``+ 1e-8``), weighs each piece ``dp * d(n_i) / d(N)``.

A token mean INSIDE a larger loss (``ce + 0.01 * aux``, a sum of two token means) cannot be
reweighted by pieces: the other terms have their own weights. Its counter is returned with
``exact=False``; the runtime then checks every step that the pieces count the same number of
labels (the plain mean is exact then) and otherwise raises, on every rank alike (each holds the
global batch), before the step computes a gradient. Never silently different.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from passes.loss_count import TokenCounter
from passes.loss_graph import (batch_ancestors, copy_nodes, graph_rows, multiple_of_rows, past_numbers,
                                varies_with_draws, zero_dim)
from passes.ops.random_ops import is_sampler
import planner.ctc_capture  # noqa: F401 - registers fairscale::ctc_loss_rows
from planner.batch_stats import source_line
from planner.graph import VALUE_KEEPING, ancestors, past_value_keeping

__all__ = ["TokenCounter", "token_counter"]

aten = torch.ops.aten

_TOKEN_MEAN = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default,
               aten.nll_loss_forward.default}
_NONE, _MEAN, _SUM = 0, 1, 2
"""``torch.nn._reduction``'s enum for ``reduction="none"``, ``"mean"`` and ``"sum"``."""
_REDUCED = {aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default,
            aten.binary_cross_entropy.default, aten.binary_cross_entropy_with_logits.default, aten.kl_div.default,
            aten.soft_margin_loss.default, aten.multi_margin_loss.default, aten.multilabel_margin_loss.default}
"""Other loss ops with a ``reduction``: their mean is a mean over rows, their sum a sum over the batch."""
_ROW_LOSSES = {torch.ops.fairscale.ctc_loss_rows.default}
"""Loss ops that give one term per row (``reduction="none"``): CTC as the capture traces it
(``planner.ctc_capture``; its ``"sum"`` is their ``.sum()``)."""
_FULL_SUMS = {aten.sum.default}
"""A sum of every element, at the graph's output, of a loss op's ``reduction="none"`` terms."""


def token_counter(gm: torch.fx.GraphModule) -> TokenCounter | None:
    """The counter of ``gm``'s loss if it is a token mean, a sum over the batch, or contains one
    (module docstring), else None."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    value = out.args[0]
    while isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.fx.Node):
        return None
    value = past_value_keeping(value)
    while (unscaled := _unscaled(value)) is not None:
        value = unscaled
    rows = graph_rows(gm)
    total = past_numbers(value, rows)  # a sum times or over a number is a sum: each piece's scaled alike
    if total.op == "call_function" and total.target in _FULL_SUMS and isinstance(total.args[0], torch.fx.Node) \
            and _reduction(past_value_keeping(total.args[0])) == _NONE and len(total.args) == 1:
        return _summed(str(past_value_keeping(total.args[0]).target), exact=True)
    if _reduction(total) == _SUM:
        return _summed(str(total.target), exact=True)
    if value.op == "call_function" and value.target in _TOKEN_MEAN:
        found = _labels_of(value)
        if found is not None:
            return _build(gm, [found], loss=str(value.target), exact=True)
    if (ratio := _count_divisor(past_numbers(value, None))) is not None:
        return _divisor_counter(gm, ratio, loss=str(ratio.total.target))
    if (why := _drawn_divisor(value)) is not None:  # (ce * mask).sum() / mask.sum(), the mask drawn in forward
        return _summed("a sum over its count", exact=False, kind="uncounted", why=why)
    sums = [n for n in gm.graph.nodes if _reduction(n) == _SUM and not _divided_by_rows(n, rows, out)]
    if sums:
        return _summed(", ".join(str(n.target) for n in sums), exact=False)
    opaque = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _TOKEN_MEAN
              and _reduction(n) == _MEAN and _labels_of(n) is None and _kwargs(n).get("weight") is not None]
    if opaque:  # class weights computed in the model: the pieces' weights cannot be counted
        return _summed(", ".join(f"{n.target} with computed class weights" for n in opaque), exact=False,
                       kind="opaque")
    uncounted = [(n, why) for n in gm.graph.nodes if n.op == "call_function" and n.target in _TOKEN_MEAN
                 and _reduction(n) == _MEAN and (why := _uncounted(n)) is not None]
    if uncounted:  # labels a piece keeps, drawn in the forward (MaskGIT's mask): not countable before the step
        return _summed(", ".join(str(n.target) for n, _ in uncounted), exact=False, kind="uncounted",
                       why=uncounted[0][1])
    inner = [(n, found) for n in gm.graph.nodes if n.op == "call_function" and n.target in _TOKEN_MEAN
             for found in [_labels_of(n)] if found is not None]
    if not inner:
        return None
    names = ", ".join(str(n.target) for n, _ in inner)
    if _same_labels([found for _, found in inner]) and _linear_in(value, {n for n, _ in inner}):
        return _build(gm, [inner[0][1]], loss=names, exact=True)
    return _build(gm, [found for _, found in inner], loss=names, exact=False)


_LINEAR = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default}
"""Ops through which a loss is a linear combination of its terms: a sum or difference of two,
a term times or over a number."""


def _linear_in(value: torch.fx.Node, means: set[torch.fx.Node]) -> bool:
    """Whether ``value`` is a combination of the nodes ``means`` with constant coefficients
    (torchvision's segmentation loss: ``out + 0.5 * aux``), and of nothing else."""
    value = past_value_keeping(value)
    if value in means:
        return True
    if value.op != "call_function" or value.target not in _LINEAR:
        return False
    nodes = [a for a in value.args if isinstance(a, torch.fx.Node)]
    numbers = [a for a in value.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    alpha = value.kwargs.get("alpha", 1)
    if len(nodes) + len(numbers) != len(value.args) or set(value.kwargs) - {"alpha"} \
            or not isinstance(alpha, (int, float)):
        return False
    if value.target in (aten.add.Tensor, aten.sub.Tensor):
        return len(nodes) == 2 and all(_linear_in(n, means) for n in nodes)
    if value.target is aten.div.Tensor:
        return len(nodes) == 1 and value.args[0] is nodes[0] and _linear_in(nodes[0], means)
    return len(nodes) == 1 and _linear_in(nodes[0], means)


def _same_labels(labels: list[_Labels]) -> bool:
    """Whether every token mean counts the same labels: one labels node, ignore_index and class
    weights. A combination of such means with constant coefficients is itself a token mean over
    those labels (``sum_k c_k S_k / n``), reweighted by pieces as one."""
    first, ignore, _, weight = labels[0]
    return all(t is first and i == ignore and w is weight for t, i, _, w in labels)


_FULL_SUM_OPS = {aten.sum.default, aten.sum.dim_IntList}


class _Ratio(NamedTuple):
    """A sum over the batch scaled by a function of a count the batch gives (:func:`_count_divisor`)."""

    total: torch.fx.Node
    """The 0-dim sum: the loss's terms over the batch."""
    counted: torch.fx.Node
    """The 0-dim sum the factor is computed from: additive over the batch's rows."""
    ancestors: set[torch.fx.Node]
    """``counted`` and the nodes it is computed from (batch inputs and ops)."""
    chain: set[torch.fx.Node]
    """The nodes between ``counted`` and ``factor`` (``factor`` included): ops on the count and constants."""
    factor: torch.fx.Node
    """What ``total`` is divided by, or multiplied with (``multiplies``)."""
    multiplies: bool


def _count_divisor(value: torch.fx.Node) -> _Ratio | None:
    """A sum over the batch divided by a count the batch's rows give, or times a function of one, or None:
    ``(terms * loss_mask).sum() / loss_mask.sum()`` (Megatron's loss mask), ESPnet's
    ``ctc_sum / ys_lens.sum()``, ``/ mask.sum().clamp(min=1)``, ``/ (mask.sum() + 1e-8)``,
    ``* mask.sum().reciprocal()``. A piece divides its own sum by its own count, so the pieces' plain
    mean is wrong whenever their counts differ (a padded batch); weighed by their divisors against the
    batch's, as a token mean's pieces are by their counts, they give the batch's loss. The count is a
    0-dim sum of values computed from batch inputs alone, and the factor is computed from that count
    and constants alone; the dividend is a 0-dim sum (whether its terms are row by row, and the count
    additive over them, is the loss check's to prove)."""
    if value.op != "call_function" or value.target not in (aten.div.Tensor, aten.mul.Tensor) \
            or len(value.args) != 2 or value.kwargs:
        return None
    a, b = value.args
    orders = [(a, b)] if value.target is aten.div.Tensor else [(a, b), (b, a)]
    for total, factor in orders:
        if not isinstance(total, torch.fx.Node) or not isinstance(factor, torch.fx.Node):
            continue
        total = past_numbers(past_value_keeping(total), None)
        summed = (total.op == "call_function" and total.target in _FULL_SUM_OPS) or _reduction(total) == _SUM
        if not summed or not zero_dim(total) or not zero_dim(factor):
            continue
        found = _count_of(factor)
        if found is not None:
            return _Ratio(total, *found, factor, value.target is aten.mul.Tensor)
    return None


def _count_of(factor: torch.fx.Node) -> tuple[torch.fx.Node, set[torch.fx.Node], set[torch.fx.Node]] | None:
    """The 0-dim sum over batch inputs ``factor`` is a function of (with constants), its ancestors and
    the chain of nodes from it to ``factor``; None when ``factor`` reads a parameter, a buffer, a draw,
    or batch values other than through one such sum."""
    seen = batch_ancestors(factor)
    if seen is None:
        return None
    for count in seen:
        if count.op != "call_function" or count.target not in _FULL_SUM_OPS or not zero_dim(count):
            continue
        inner = batch_ancestors(count)
        assert inner is not None
        chain = seen - inner
        if all(n.op != "placeholder" and all(i in chain or i is count for i in n.all_input_nodes) for n in chain) \
                and any(
                n.op == "placeholder" and isinstance(v := n.meta.get("val"), torch.Tensor) and v.dim() > 0
                for n in inner):
            return count, inner, chain
    return None


def _drawn_divisor(value: torch.fx.Node) -> str | None:
    """The draw a sum over the batch divided by a count (:func:`_count_divisor`'s form) takes its
    count from (MaskGIT's masked mean, ``(ce * mask).sum() / mask.sum()`` over a mask drawn in
    forward), with its op and line, or None: no piece's count is known before its forward draws it."""
    if value.op != "call_function" or value.target is not aten.div.Tensor or len(value.args) != 2 or value.kwargs:
        return None
    total, count = value.args
    if not isinstance(total, torch.fx.Node) or not isinstance(count, torch.fx.Node):
        return None
    total, source = past_value_keeping(total), past_value_keeping(count)
    summed = (total.op == "call_function" and total.target in _FULL_SUM_OPS) or _reduction(total) == _SUM
    if not summed or not zero_dim(total) or not zero_dim(count) or source.op != "call_function" \
            or source.target not in _FULL_SUM_OPS:
        return None
    draw = next((n for n in ancestors(count, into_bodies=True) if is_sampler(n)), None)
    if draw is None or not varies_with_draws(count, lambda v: v):
        return None  # (ViTMAE's mask: the draw orders each row's patches, every row keeps as many)
    line = source_line(draw)
    return f"a random draw (op {draw.target}" + (f", source {line}" if line else "") + ")"


def _divisor_counter(gm: torch.fx.GraphModule, ratio: _Ratio, *, loss: str) -> TokenCounter:
    """A counter graph that computes the count of ``ratio`` (:func:`_count_divisor`) on a piece, in
    float64, and the graph of the divisor as a function of the count (where it is not the count itself)."""
    graph, env, inputs = copy_nodes(gm, ratio.ancestors)
    graph.output(graph.call_function(aten._to_copy.default, (env[ratio.counted],), {"dtype": torch.float64}))
    divisor = None
    if ratio.multiplies or any(n.target not in VALUE_KEEPING for n in ratio.chain):  # not the count itself
        divisor = _divisor_graph(gm, ratio)
    return TokenCounter(gm=torch.fx.GraphModule(torch.nn.Module(), graph), batch_inputs=inputs, ignore_index=-100,
                        loss=loss, exact=True, divides=True, divisor=divisor)


def _divisor_graph(gm: torch.fx.GraphModule, ratio: _Ratio) -> torch.fx.GraphModule:
    """``divisor(count) -> float64``: what a piece's sum is divided by, for its count (the reciprocal
    of the factor where the loss multiplies by it)."""
    graph = torch.fx.Graph()
    env = {ratio.counted: graph.placeholder("count")}
    env[ratio.counted].meta["val"] = ratio.counted.meta.get("val")  # its device: where the count is made
    for node in gm.graph.nodes:
        if node in ratio.chain:
            env[node] = graph.node_copy(node, lambda x: env[x])
    out = graph.call_function(aten._to_copy.default, (env[ratio.factor],), {"dtype": torch.float64})
    if ratio.multiplies:
        out = graph.call_function(aten.reciprocal.default, (out,))
    graph.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


_SCALINGS = {aten.div.Tensor: (0,), aten.mul.Tensor: (0, 1)}
"""Ops that scale a loss, and which of their two arguments may be the loss."""


def _unscaled(value: torch.fx.Node) -> torch.fx.Node | None:
    """The loss ``value`` divides or multiplies by a 0-dim batch input, or None. Every piece of
    the batch gets such an input whole (Hugging Face's ``loss = cross_entropy(..., reduction="sum")
    / num_items_in_batch``), so the pieces' losses add up, or average, as the loss's own would. A
    number is not such a factor: the capture bakes ``x.size(0)`` in as one, and the pieces'
    ``sum / rows`` would each divide by their own rows."""
    if value.op != "call_function" or value.target not in _SCALINGS or len(value.args) != 2 or value.kwargs:
        return None
    for i in _SCALINGS[value.target]:
        loss, factor = value.args[i], value.args[1 - i]
        if isinstance(loss, torch.fx.Node) and isinstance(factor, torch.fx.Node):
            source = past_value_keeping(factor)
            val = source.meta.get("val")
            if source.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() == 0:
                return past_value_keeping(loss)
    return None


def _divided_by_rows(node: torch.fx.Node, rows: int | None, output: torch.fx.Node) -> bool:
    """Whether every path from ``node`` to the graph's output passes a division by a multiple of the
    graph's rows (``kl_div(reduction="batchmean")``, of token logits ``view(-1, V)`` too, a VAE's
    ``(bce_sum + kld_sum) / x.size(0)``): then the
    sum is a mean over the rows, as a piece computes it on its own rows, not a sum over the batch
    (whether its terms are row by row is the loss check's to prove: ``fairscale.loss_check``)."""
    if rows is None:
        return False
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user is output:
                return False
            if user.target in (aten.div.Tensor, aten.div.Scalar) and user.args[0] is n \
                    and multiple_of_rows(user.args[1], rows):
                continue
            stack.append(user)
    return True


def _kwargs(node: torch.fx.Node) -> dict[str, object]:
    assert callable(node.target)
    norm = normalize_function(node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True)
    return dict(norm.kwargs) if norm is not None else {}


def _reduction(node: torch.fx.Node) -> int | None:
    """A loss op's reduction (``_NONE``, ``_MEAN``, ``_SUM``), None for any other node."""
    if node.op == "call_function" and node.target in _ROW_LOSSES:
        return _NONE
    if node.op != "call_function" or (node.target not in _TOKEN_MEAN and node.target not in _REDUCED):
        return None
    return int(_kwargs(node).get("reduction", _MEAN))  # type: ignore[call-overload]


def _summed(loss: str, *, exact: bool, kind: str = "sum", why: str = "") -> TokenCounter:
    """The record of a loss that adds over the batch's rows (each piece weighs ``dp``), or
    (``opaque``) one whose pieces' weights cannot be known: nothing to count."""
    graph = torch.fx.Graph()
    graph.output(graph.call_function(aten.scalar_tensor.default, (1,), {"dtype": torch.int64}))
    return TokenCounter(gm=torch.fx.GraphModule(torch.nn.Module(), graph), batch_inputs=[], ignore_index=-100,
                        loss=loss, exact=exact, kind=kind, why=why)


_Labels = tuple[torch.fx.Node, int, set[torch.fx.Node], torch.fx.Node | None]
"""A token mean's labels node, its ignore_index, the nodes the labels are computed from, and its
class weights (None: every label weighs 1)."""


def _labels_of(value: torch.fx.Node) -> _Labels | None:
    """The labels of the mean token loss ``value``; None for another reduction, class weights that
    are not constants or parameters, or labels that are not a function of the batch alone."""
    kwargs = _kwargs(value)
    if kwargs.get("reduction", _MEAN) != _MEAN:
        return None
    weight = kwargs.get("weight")
    if weight is not None and not (isinstance(weight, torch.fx.Node) and weight.op == "get_attr"):
        return None
    target = kwargs.get("target")
    if not isinstance(target, torch.fx.Node):
        return None
    seen = batch_ancestors(target)
    if seen is None:
        return None  # labels computed from parameters, buffers or a draw (mixup's y[randperm]): not the batch's
    return target, int(kwargs.get("ignore_index", -100)), seen, weight  # type: ignore[call-overload]


def _uncounted(value: torch.fx.Node) -> str | None:
    """What the labels of the mean token loss ``value`` are computed from (a random draw, the model's
    parameters or buffers, with its op and line) when no piece can count them (:func:`_labels_of` is
    None) and they may hold its ``ignore_index`` (a literal of that value feeds them: MaskGIT's
    ``torch.where(mask, ids, ignore_index)`` over a mask drawn in forward); else None: labels that
    never hold it (a teacher's ``argmax``) count every token in every piece, and the plain mean is exact."""
    kwargs = _kwargs(value)
    target = kwargs.get("target")
    weight = kwargs.get("weight")
    if not isinstance(target, torch.fx.Node) or _labels_of(value) is not None \
            or (weight is not None and not (isinstance(weight, torch.fx.Node) and weight.op == "get_attr")):
        return None  # (counted, or class weights the model computes: kind "opaque")
    ignore = int(kwargs.get("ignore_index", -100))  # type: ignore[call-overload]
    nodes = ancestors(target, into_bodies=True)
    if not any(_gives(n, ignore) for n in nodes):
        return None
    source = next((n for n in nodes if is_sampler(n)), None)
    what = "a random draw"
    if source is not None and not varies_with_draws(target, lambda v: (v != ignore).sum()):
        return None  # every draw keeps as many labels (a fixed number per row): the plain mean is exact
    if source is None:
        source = next((n for n in nodes if n.op == "get_attr" and not _is_body(n)), None)
        what = "the model's parameters or buffers"
    if source is None:
        return None
    line = source_line(source)
    return f"{what} (op {source.target}" + (f", source {line}" if line else "") + ")"


def _is_body(node: torch.fx.Node) -> bool:
    """Whether the get_attr ``node`` fetches a higher-order op's body (a GraphModule), not a tensor."""
    obj: object = node.graph.owning_module
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
    return isinstance(obj, torch.fx.GraphModule)


def _gives(node: torch.fx.Node, ignore: int) -> bool:
    """Whether ``node`` takes the number ``ignore`` as an argument (a fill value, a ``where`` branch)."""
    if node.op != "call_function":
        return False
    found: list[bool] = []
    torch.fx.node.map_aggregate((node.args, node.kwargs), lambda a: found.append(
        isinstance(a, (int, float)) and not isinstance(a, bool) and a == ignore))
    return any(found)


def _build(gm: torch.fx.GraphModule, labels: list[_Labels], *, loss: str, exact: bool) -> TokenCounter:
    """A counter graph: the ops ``labels`` are computed with, then each one's count of labels kept
    (one scalar, or a vector of one count per token mean when there are several): int64, or the
    sum of the kept labels' class weights in float64 where a token mean has them."""
    graph, env, inputs = copy_nodes(gm, set().union(*(ancestors for _, _, ancestors, _ in labels)))
    root = torch.nn.Module()
    weighted = any(w is not None for *_, w in labels)
    counts = []
    for i, (t, ignore, _, weight) in enumerate(labels):
        kept = graph.call_function(aten.ne.Scalar, (env[t], ignore))
        if weight is None:
            count = graph.call_function(aten.sum.default, (kept,))
        else:  # the class weights of the labels kept: w[label] where not ignored, else 0
            root.register_buffer(f"class_weight_{i}", _attr(gm, str(weight.target)), persistent=False)
            w = graph.call_method("to", (graph.get_attr(f"class_weight_{i}"),
                                         graph.call_function(getattr, (env[t], "device"))))
            safe = graph.call_function(aten.where.ScalarOther, (kept, env[t], 0))
            picked = graph.call_function(aten.index.Tensor, (w, [safe]))
            count = graph.call_function(aten.sum.default, (graph.call_function(aten.where.ScalarOther,
                                                                                 (kept, picked, 0.0)),))
        if weighted:
            count = graph.call_function(aten._to_copy.default, (count,), {"dtype": torch.float64})
        counts.append(count)
    graph.output(counts[0] if len(counts) == 1 else graph.call_function(aten.stack.default, (counts,)))
    return TokenCounter(gm=torch.fx.GraphModule(root, graph), batch_inputs=inputs,
                        ignore_index=labels[0][1], loss=loss, exact=exact)


def _attr(gm: torch.fx.GraphModule, target: str) -> torch.Tensor:
    """The tensor at ``target`` (a get_attr node's dotted path) of ``gm``: a constant the capture
    lifted, or a parameter (shared, so the counter reads its current value)."""
    obj: object = gm
    for name in target.split("."):
        obj = getattr(obj, name)
    assert isinstance(obj, torch.Tensor)
    return obj.detach()
