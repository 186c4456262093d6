"""The record of a token-mean loss the runtime reads: how many labels a piece of the batch counts.

``passes.loss_weights.token_counter`` makes it from a captured graph (that module's docstring:
why a token mean cut into pieces needs weights); ``fairscale.runtime.engine`` calls it on each
piece of every step. A leaf: it imports no pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx

__all__ = ["TokenCounter", "piece_weights", "sum_problem"]


@dataclass
class TokenCounter:
    """``counter(batch)``: how many labels of ``batch`` (a flat batch tuple) the loss counts."""

    gm: torch.fx.GraphModule
    """``gm(*batch inputs it reads) -> int64 scalar`` (a vector for several token means): the
    labels' ops, then ``(labels != ignore).sum()``."""
    batch_inputs: list[int]
    """Indices into the flat batch of the inputs ``gm`` reads, in placeholder order."""
    ignore_index: int
    """The label value the loss skips (the first token mean's)."""
    loss: str
    """The loss node's op (``aten.cross_entropy_loss.default``), for messages."""
    exact: bool = True
    """True when the graph's output IS the token mean (pieces can be reweighted); False when the
    token mean is one part of a larger loss (pieces must count the same labels, or the step is refused)."""
    kind: str = "mean"
    """``mean``: the loss averages over the labels it counts (pieces weigh by their counts);
    ``sum``: it adds over the batch's rows (every piece weighs ``dp``; nothing to count);
    ``opaque``: a token mean whose class weights the model computes (no piece weights known);
    ``uncounted``: a token mean whose labels the forward computes from a random draw (or the model's
    weights) and may hold ``ignore_index``: no piece's count is known before the step."""
    divides: bool = False
    """The loss divides by the count itself (``(l * mask).sum() / mask.sum()``), so a piece that
    counts nothing computes 0 / 0: its loss and gradient are nan, weighed 0 or not."""
    divisor: torch.fx.GraphModule | None = None
    """``divisor(count) -> float64 0-dim``: what the loss divides its sum by, for a count, where it is
    not the count itself (``mask.sum().clamp(min=1)``, ``mask.sum() + 1e-8``); a piece then weighs
    ``dp * divisor(n_i) / divisor(N)``."""
    why: str = ""
    """For ``uncounted``: what the labels are computed from, with its op and source line."""

    def __call__(self, batch: Sequence[Any]) -> int | float | tuple[Any, ...]:
        """The count (a tuple of counts, one per token mean, when the loss holds several)."""
        return self.count_all([batch])[0]

    def count_all(self, pieces: Sequence[Sequence[Any]]) -> list[Any]:
        """Each piece's count, read to the host at once: one host sync per call, however many pieces."""
        if self.kind != "mean":  # a sum, or class weights the model computes: nothing to count
            return [1] * len(pieces)
        with torch.no_grad():
            counts = torch.stack([self.gm(*[piece[i] for i in self.batch_inputs]) for piece in pieces]).tolist()
        return [tuple(c) if isinstance(c, list) else c for c in counts]

def piece_weights(counter: TokenCounter, counts: list[list[Any]], dp_index: int) -> list[float] | None:
    """Weights of dp rank ``dp_index``'s pieces in the step's loss, from ``counts[d][i]`` (the
    labels piece ``i`` of dp rank ``d`` counts): ``dp * n / N`` each, or None when every piece
    counts the same (the plain mean is the token mean then); ``dp`` each for a sum over the batch.
    Raises when the token mean is part of a larger loss (``counter.exact`` False) and the pieces
    differ, or a sum is part of one and there are pieces: no weights make that exact."""
    dp, m = len(counts), len(counts[0])
    if counter.kind in ("sum", "opaque", "uncounted"):
        problem = sum_problem(counter, dp, m)
        if problem:
            raise ValueError(problem)
        return [float(dp)] * m  # the sum of the pieces: dp averages the ranks' gradients, so each weighs dp
    flat = [n for row in counts for n in row]
    if counter.divisor is not None:
        return _divided(counter, counts, dp_index)
    if counter.divides and 0 in flat and any(flat):
        raise ValueError(
            f"the loss divides a sum by a count the batch gives ({counter.loss}), and a piece of this batch's "
            f"{dp * m} (dp={dp} x {m} microbatches) counts nothing ({flat}): its loss is 0 / 0, which would make the "
            "gradient nan where the whole batch's is finite. Give every piece rows that count (sort or shuffle the "
            "padded rows across the batch), or use fewer pieces")
    if len(set(flat)) <= 1:
        return None
    if not counter.exact:
        raise ValueError(
            f"the loss is a token mean ({counter.loss}) combined with other terms, and this batch's {dp * m} pieces "
            f"(dp={dp} x {m} microbatches) count different numbers of labels not equal to ignore_index ({flat}): "
            "the mean of the pieces' losses is not the batch's loss, and the pieces cannot be reweighted because "
            "the other terms have their own weights. Make the pieces count the same labels (no ignored labels, or "
            "the same number per row), return the token mean alone as the loss, or compute the mean over the "
            "whole batch yourself (sum the terms and divide by the global count, as Hugging Face's "
            "num_items_in_batch does)")
    total = sum(flat)  # > 0: the counts differ
    return [dp * n / total for n in counts[dp_index]]


def _divided(counter: TokenCounter, counts: list[list[Any]], dp_index: int) -> list[float] | None:
    """Weights ``dp * d(n_i) / d(N)`` of a loss whose sum is divided by ``d(count)``
    (``TokenCounter.divisor``): each piece's loss is ``S_i / d(n_i)``, so weighed they add up to
    ``S / d(N)``, the batch's, whatever ``d`` is. None (the plain mean) where the batch's own divisor
    is 0 or not finite (one process's loss is not finite either)."""
    assert counter.divisor is not None
    dp, m = len(counts), len(counts[0])
    flat = [n for row in counts for n in row]
    count = next(n for n in counter.divisor.graph.nodes if n.op == "placeholder").meta.get("val")
    device = count.device if isinstance(count, torch.Tensor) else torch.device("cpu")  # the graph's constants'
    with torch.no_grad():
        divisors = [float(counter.divisor(torch.tensor(float(n), dtype=torch.float64, device=device)))
                    for n in (*flat, sum(flat))]
    whole = divisors.pop()
    if whole == 0 or not math.isfinite(whole):
        return None
    bad = [d for d in divisors if d == 0 or not math.isfinite(d)]
    if bad:
        raise ValueError(
            f"the loss divides a sum by a function of a count the batch gives ({counter.loss}), and a piece of this "
            f"batch's {dp * m} (dp={dp} x {m} microbatches) divides by {bad[0]} (counts {flat}): its loss is not "
            "finite where the whole batch's is. Give every piece rows that count (sort or shuffle the padded rows "
            "across the batch), or use fewer pieces")
    return [dp * d / whole for d in divisors[dp_index * m:(dp_index + 1) * m]]


def sum_problem(counter: TokenCounter | None, dp: int, m: int) -> str | None:
    """Why a step cut into ``dp`` x ``m`` pieces cannot compute a loss that adds a sum over the
    batch to other terms, or a mean weighted by class weights the model computes (known before any
    batch: the compile check refuses such a plan), or None."""
    if counter is None or counter.kind == "mean" or counter.exact or dp * m == 1:
        return None
    if counter.kind == "uncounted":
        return (f"the loss is a mean ({counter.loss}) over the labels or positions its forward keeps, which it "
                f"computes from {counter.why}: the step is cut into {dp * m} pieces (dp={dp} x {m} microbatches), "
                "each the mean over what it keeps, and how many each keeps is known only once its forward "
                "has drawn them, so the pieces cannot be weighed as the batch's mean weighs them (their plain "
                "mean weighs a label of a piece that keeps few more than one of a piece that keeps many). Make the "
                "mask in the data pipeline and pass the labels with the batch (each piece's labels are then "
                "counted), divide a sum of the terms by a count passed with the batch (as Hugging Face's "
                "num_items_in_batch), or train on one piece (dp=1, one microbatch)")
    if counter.kind == "opaque":
        return (f"the loss is a class-weighted mean ({counter.loss}): the step is cut into {dp * m} pieces "
                f"(dp={dp} x {m} microbatches), whose weights in the batch's loss are the sums of their labels' "
                "class weights, which the model computes, so they cannot be counted before the step. Pass the "
                "class weights as a constant tensor or a buffer (cross_entropy(..., weight=self.class_weight)), "
                "or train on one piece (dp=1, one microbatch)")
    return (f"the loss adds a sum over the batch ({counter.loss}) to other terms, and the step is cut into "
            f"{dp * m} pieces (dp={dp} x {m} microbatches): the pieces' sums add up, the other terms average, "
            "and no weights of the pieces' losses make both exact. Return the sum alone as the loss, use "
            "reduction=\"mean\" (and scale the learning rate), or train on one piece (dp=1, one microbatch)")

