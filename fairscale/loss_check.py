"""Is the loss computed row by row, as a step cut into pieces assumes?

A data-parallel or microbatched step computes the loss on pieces of the batch (dp slices,
microbatches) and combines the pieces' losses: their mean, weighed by their labels for a token
mean, their sum for a loss that sums over the batch (``passes.loss_weights``). That is the batch's
loss only when each row's terms depend on that row alone. A loss that couples the rows (the
in-batch negatives of a contrastive loss, a batch statistic or a product of two batch means in
the loss, a router's capacity) or sums over them by hand (``(out - y).pow(2).sum()``, or a fixed
divisor) is not: cut into pieces it trains silently to other numbers.

:func:`row_problem` checks it on the example batch, cut as the plan would cut it but into at most
:data:`CHECK_ROWS` rows per piece: two pieces, each piece's loss against the loss of both together,
in eval mode (no dropout, batch norm on its running statistics: how the runtime treats those is
another matter), without gradients and from the same random state. A model on the meta device is
not checked.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from passes.loss_count import TokenCounter, piece_weights, sum_problem
from passes.loss_weights import token_counter
from planner.capture import LossModule
from planner.plan import Plan

__all__ = ["loss_problem", "row_problem", "CHECK_ROWS"]

CHECK_ROWS = 2
"""Rows per piece the check runs at most (four rows' forwards in all, whatever the batch): a loss that
couples its rows differs already between two rows together and apart, and every plan whose pieces
hold at least this many rows shares one verdict (one check per model in a search, not one per
piece size)."""


def loss_problem(model: nn.Module, example_inputs: Sequence[Any], loss_fn: Callable[..., torch.Tensor] | None,
                 gm: torch.fx.GraphModule, plan: Plan, verdicts: dict[int, str | None]) -> str | None:
    """Why ``plan``'s pieces (dp × microbatches) cannot make the loss of ``gm`` (the model's
    capture) exactly: a sum beside other terms (``passes.loss_count.sum_problem``), or a loss not
    computed row by row (:func:`row_problem`, its verdicts kept in ``verdicts`` by rows per piece)."""
    dp, m = plan.mesh.dp, plan.schedule.microbatches
    counter = token_counter(gm)
    problem = sum_problem(counter, dp, m)
    first = next((t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if problem or dp * m == 1 or first is None:
        return problem
    rows = min(first.shape[0] // (dp * m), CHECK_ROWS)
    if rows not in verdicts:
        verdicts[rows] = row_problem(model, example_inputs, loss_fn, counter, rows)
    return verdicts[rows]


def row_problem(model: nn.Module, example_inputs: Sequence[Any], loss_fn: Callable[..., torch.Tensor] | None,
                counter: TokenCounter | None, rows: int) -> str | None:
    """Why the loss is not the combination of its pieces' losses on ``rows``-row pieces of the
    example batch (module docstring), or None (it is, or it cannot be checked here)."""
    batch = tuple(example_inputs)
    tensors = [t for t in batch if isinstance(t, torch.Tensor) and t.dim() > 0]
    if rows < 1 or not tensors or any(t.shape[0] < 2 * rows for t in tensors) \
            or any(p.is_meta for p in model.parameters()):
        return None
    whole = _rows(batch, 0, 2 * rows)
    pieces = [_rows(batch, 0, rows), _rows(batch, rows, 2 * rows)]
    try:
        values = [_loss(model, loss_fn, b) for b in (whole, *pieces)]
    except Exception:  # noqa: BLE001 - a model that cannot run on these rows eagerly is not judged here
        return None
    combined = _combine(counter, values[1:], pieces)
    if combined is None:
        return None
    got, want = values[0], combined
    tol = 1e-3 if torch.finfo(torch.promote_types(torch.float32, _dtype(model))).bits >= 32 else 5e-2
    if abs(got - want) <= tol * max(abs(got), abs(want)) + 1e-6:
        return None
    how = {None: "the mean of the pieces' losses", "mean": "the pieces' losses weighed by their labels",
           "sum": "the sum of the pieces' losses"}[None if counter is None else counter.kind]
    return (f"the loss is not computed row by row: on the example batch, rows 0-{2 * rows - 1} give {got:.6g}, "
            f"but {how} (rows 0-{rows - 1}, {rows}-{2 * rows - 1}) is {want:.6g}. Cut into pieces (dp x "
            "microbatches), the step would train to other numbers: the loss couples the rows (in-batch "
            "negatives of a contrastive loss, a batch statistic, a product of batch means) or sums over them by "
            "hand. Use a plan that keeps the batch whole (mesh.dp 1 and schedule.microbatches 1: tensor "
            "parallelism, or a pipeline of one microbatch), or make the loss a mean over rows")


def _rows(batch: tuple[Any, ...], lo: int, hi: int) -> tuple[Any, ...]:
    """Rows ``lo:hi`` of every tensor the runtime slices (dim 0 of each tensor with dims)."""
    return tuple(t[lo:hi] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in batch)


def _dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _loss(model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, batch: tuple[Any, ...]) -> float:
    """The loss of ``batch``, in eval mode, without gradients, from a fixed random state; the
    modules' training flags are restored after."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return float(LossModule(model, loss_fn)(*batch).double())
    finally:
        for m, training in flags:
            m.training = training


def _combine(counter: TokenCounter | None, losses: list[float], pieces: list[tuple[Any, ...]]) -> float | None:
    """The batch's loss as the runtime makes it from the pieces' ``losses``: their weights of
    ``passes.loss_count.piece_weights``, as for one dp rank holding every piece. None where there
    is no rule to check against: pieces it cannot weigh (a token mean or a sum beside other terms
    that count differently, class weights the model computes), several token means, no labels."""
    if counter is None:
        return sum(losses) / len(losses)
    counts = counter.count_all(pieces)
    if any(isinstance(n, tuple) for n in counts) or (counter.kind == "mean" and not any(counts)):
        return None
    try:
        weights = piece_weights(counter, [counts], 0)
    except ValueError:
        return None
    if weights is None:  # every piece counts the same: the plain mean
        return sum(losses) / len(losses)
    return sum(w * v for w, v in zip(weights, losses) if w)
