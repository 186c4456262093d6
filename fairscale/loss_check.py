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
another matter), from the same random state, on the user's model itself unless its forward writes
a parameter (then on a copy). Where neither the proof on the graph (``planner.row_flow``, tried
first) nor this check can judge the loss (the model does not run in eval mode on those rows, no
rows of the batch count labels that can be weighed), a plan that cuts the batch is refused too:
it would combine the pieces on trust. A model on the meta device is planned, never run, and not
checked. Random draws in the forward (``ViTMAEForPreTraining``'s masking noise) are made constant
for the check (``fairscale.loss_check_mode.ConstantDraws``: a row's draws would otherwise depend on
the rows drawn before it); where a random op it does not fix (``multinomial``, ``randperm``) still
makes the batch and its pieces differ, the refusal names that op and says to pass the values in as
an input.

The losses alone are not enough: a mean over a number of terms that differs between the pieces
(``logits[mask]`` then a mean, as ``ElectraForPreTraining`` does with an attention mask) gives
about the same value whichever way its terms are weighed while they are all about equal, as at
initialization (0.6913 against 0.6913 for binary cross entropy at ``log 2``), but its gradient is
off by the pieces' share (5% there; 21% of the gradient when it trained under dp2). So the
gradients are compared too, each as one random projection per parameter tensor (a few numbers,
not a copy of the gradient), combined with the same weights as the losses, as a whole and tensor by
tensor: a term that couples the rows with a small weight (a router's load-balancing loss x 0.001)
moves the loss and the whole gradient less than their tolerance, and its parameters' gradients by
more (``fairscale.loss_check_runs.GRAD_TOL``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch import nn

from fairscale.loss_check_mode import draws_constant, eval_path
from fairscale.loss_check_runs import GRAD_TOL, batch_rows, gradient_error, param_dtype, run_batches
from passes.ops.random_ops import random_nodes
from passes.loss_count import TokenCounter, piece_weights, sum_problem
from passes.loss_weights import token_counter
from planner.batch_stats import source_line
from planner.buffer_writes import find_buffer_writes, writes_differ
from planner.graph import META_MODULE
from planner.plan import KEEP_BATCH_WHOLE, Plan
from planner.row_counts import batch_count_problem

__all__ = ["loss_problem", "row_problem", "count_problem", "scan_problem", "proven_row_by_row", "CHECK_ROWS", "PROOF_ROWS"]

CHECK_ROWS = 2
"""Rows per piece the row check runs at most (four rows' forwards in all, whatever the batch): a
loss that couples its rows differs already between two rows together and apart, and every plan
whose pieces hold at least this many rows shares one verdict (one check per model in a search, not
one per piece size)."""


def loss_problem(model: nn.Module, example_inputs: Sequence[Any], loss_fn: Callable[..., torch.Tensor] | None,
                 gm: torch.fx.GraphModule, plan: Plan, verdicts: dict[Any, str | None]) -> str | None:
    """Why ``plan``'s pieces (dp × microbatches) cannot make the loss of ``gm`` (the model's
    capture) exactly: a sum beside other terms (``passes.loss_count.sum_problem``), or a loss not
    computed row by row (:func:`row_problem`, its verdicts kept in ``verdicts`` by rows per piece)."""
    dp, m = plan.mesh.dp, plan.schedule.microbatches
    if dp > 1 and (problem := _write_problem(model, example_inputs, loss_fn, gm, plan)):
        return problem
    counter = token_counter(gm)
    problem = sum_problem(counter, dp, m)
    if problem:
        hf = (" (A Hugging Face model given num_items_in_batch sums its loss and divides by that count, which "
              "plans alone; beside other terms, call it without num_items_in_batch for a plan that cuts the batch)"
              ) if counter and counter.kind == "sum" else ""
        return f"{problem}.{_loss_site(gm, counter)}{hf}"
    first = next((t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if dp * m == 1 or first is None:
        return None
    if counter is not None and counter.kind == "mean" and not counter.exact:
        problem = count_problem(gm, counter, example_inputs, dp, m)
        if problem:
            return problem
    if "proof" not in verdicts:  # row by row on the graph, for every plan: no model run needed
        verdicts["proof"] = None if proven_row_by_row(model, example_inputs, loss_fn) else "not proven"
    if verdicts["proof"] is None:
        return None
    if "scan" not in verdicts:  # a coupling the eager check sees only where the example batch triggers it
        verdicts["scan"] = scan_problem(model, example_inputs, loss_fn)
    if verdicts["scan"] is not None:
        return verdicts["scan"]
    if counter is None and (problem := batch_count_problem(gm)):  # a count the example batch's pieces share
        return problem
    if "eval path" not in verdicts:  # where the model parts from its training path in eval mode, if it does
        verdicts["eval path"] = None if any(p.is_meta for p in model.parameters()) else \
            eval_path(model, batch_rows(tuple(example_inputs), 0, PROOF_ROWS[0]), loss_fn)
    rows = max(1, min(first.shape[0] // (dp * m), CHECK_ROWS))
    if rows not in verdicts:
        verdicts[rows] = row_problem(model, example_inputs, loss_fn, counter, rows, gm=gm,
                                     eval_path=verdicts["eval path"])
    return verdicts[rows]


def _write_problem(model: nn.Module, example_inputs: Sequence[Any], loss_fn: Callable[..., torch.Tensor] | None,
                   gm: torch.fx.GraphModule, plan: Plan) -> str | None:
    """Why a write no batch input feeds in ``gm`` (a rank's capture) still depends on the rows: the
    whole batch's capture computes it otherwise (``planner.buffer_writes.writes_differ``: a count of
    the rows seen, ``self.seen += x.shape[0]``, is a number each capture bakes in)."""
    from fairscale.capture_cache import rank_capture, trace_dtype
    from fairscale.runtime.batch_form import microbatch_example

    writes = find_buffer_writes(gm)
    if not writes or any(w.from_rows for w in writes) or any(p.is_meta for p in model.parameters()):
        return None  # (writes the rows feed: refused by planner.validate; a model on meta is traced by fx)
    rows = plan.schedule.global_batch or min(t.shape[0] for t in example_inputs if isinstance(t, torch.Tensor)
                                             and t.dim() > 0)
    whole = rank_capture(model, microbatch_example(example_inputs, rows), loss_fn=loss_fn, dtype=trace_dtype(plan))
    if not writes_differ(gm, whole.gm):
        return None
    return (f"mesh.dp: the model's forward writes {', '.join(w.describe() for w in writes[:4])} in place from a "
            f"number the batch's size gives (a count of the rows seen): a rank's capture of {rows // plan.mesh.dp} "
            f"rows computes it otherwise than the whole batch of {rows}, so each of the dp={plan.mesh.dp} ranks would "
            f"write it from its slice. {_KEEP_WHOLE}, or move the update into the training loop")


PROOF_ROWS = (2, 4)
"""Rows of the two captures :func:`proven_row_by_row` compares (``planner.row_flow.same_but_rows``)."""


def proven_row_by_row(model: nn.Module, example_inputs: Sequence[Any],
                      loss_fn: Callable[..., torch.Tensor] | None) -> bool:
    """Whether the captured graph proves the loss is computed row by row, as the runtime combines
    its pieces (``planner.row_flow``), so that the eager :func:`row_problem` need not run: two
    captures of the example batch's first 2 and 4 rows are one graph up to the batch's size, and
    the batch's rows reach the loss of the first on their own. False: not proven (the eager check
    decides). A few captures on fake tensors, where the eager check ran the model four rows
    forward and backward (55 of the 63 s ``fairscale.plan`` took for Hugging Face's GPT-2 with its
    default config on a batch of 8 × 1024 tokens, on two cores)."""
    from fairscale.capture_cache import rank_capture
    from planner.row_flow import rows_independent, same_but_rows

    batch = tuple(example_inputs)
    tensors = [t for t in batch if isinstance(t, torch.Tensor) and t.dim() > 0]
    small, large = PROOF_ROWS
    if not tensors or any(t.shape[0] < large for t in tensors) or any(p.is_meta for p in model.parameters()):
        return False  # (a model on meta is not checked at all: row_problem)
    try:
        a = rank_capture(model, batch_rows(batch, 0, small), loss_fn=loss_fn).gm
        b = rank_capture(model, batch_rows(batch, 0, large), loss_fn=loss_fn).gm
    except Exception:  # noqa: BLE001 - what cannot be captured here is left to the eager check
        return False
    counter = token_counter(a)
    if counter is not None and (counter.kind != "mean" or not counter.exact):
        return False  # a sum, or a token mean beside other terms: passes.loss_count and the eager check judge it
    return same_but_rows(a, b, small, large) is None and rows_independent(a, token_mean=counter is not None)


def scan_problem(model: nn.Module, example_inputs: Sequence[Any],
                 loss_fn: Callable[..., torch.Tensor] | None) -> str | None:
    """Why a cut batch would number its rows otherwise than the batch (``planner.row_flow.
    scans_over_rows``: a scan such as ``cumsum`` along a dim that holds the batch's rows, the
    capacity count of DeepSpeed's and fairseq's MoE gates), or None. The eager check cannot judge
    it: it changes the loss only where the data makes it (tokens past an expert's capacity), which
    the example batch may not do while later batches do (a padded batch routes its padding to one
    expert). Found on the two captures of :func:`proven_row_by_row`, cached."""
    from fairscale.capture_cache import rank_capture
    from planner.row_flow import MOVES, scans_over_rows

    batch = tuple(example_inputs)
    tensors = [t for t in batch if isinstance(t, torch.Tensor) and t.dim() > 0]
    small, large = PROOF_ROWS
    if not tensors or any(t.shape[0] < large for t in tensors) or any(p.is_meta for p in model.parameters()):
        return None
    try:
        a = rank_capture(model, batch_rows(batch, 0, small), loss_fn=loss_fn).gm
        b = rank_capture(model, batch_rows(batch, 0, large), loss_fn=loss_fn).gm
    except Exception:  # noqa: BLE001 - what cannot be captured here is left to the eager check
        return None
    found = scans_over_rows(a, b, small, large)
    if not found and (moved := scans_over_rows(a, b, small, large, ops=MOVES)):
        return (f"the loss is not computed row by row: {moved[0].target} along a dim that holds the batch's rows, at "
                f"{_site(moved[0])}, gives each row other rows' values; cut into pieces (dp x microbatches), each piece "
                f"moves its own rows' values. {_KEEP_WHOLE}, or move values along each row's own dims")
    if not found:
        return None
    return (f"the loss is not computed row by row: a scan along a dim that holds the batch's rows, at "
            f"{_site(found[0])}, makes each row's result depend on the rows before it (a router numbering every token "
            "of the batch to drop those past an expert's capacity). Cut into pieces (dp x microbatches), each piece "
            "numbers its own tokens and the step trains to other numbers whenever a piece's tokens overflow "
            "otherwise than the batch's, which depends on the data, not only on this example batch. "
            f"{_KEEP_WHOLE}, or scan along each row (a capacity per sequence: cumsum over the sequence's dim)")


def count_problem(gm: torch.fx.GraphModule, counter: TokenCounter, example_inputs: Sequence[Any], dp: int,
                  m: int) -> str | None:
    """The runtime's refusal of a step (``passes.loss_count.piece_weights``), made before launch on
    the example batch cut as the plan cuts it: a token mean beside other terms (BERT's masked-LM
    plus next-sentence loss) whose pieces count different numbers of labels. Every step of such
    data would be refused on the ranks; a batch whose pieces count alike (start and end positions
    of question answering, none ignored) passes here and trains."""
    batch = tuple(example_inputs)
    first = next(t for t in batch if isinstance(t, torch.Tensor) and t.dim() > 0)
    if first.shape[0] % (dp * m):
        return None
    rows = first.shape[0] // (dp * m)
    try:
        counts = counter.count_all([batch_rows(batch, k * rows, (k + 1) * rows) for k in range(dp * m)])
        piece_weights(counter, [counts[d * m:(d + 1) * m] for d in range(dp)], 0)
    except ValueError as e:
        node = next((n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) in counter.loss), None)
        where = f" ({_site(node)})" if node is not None else " the loss"
        return f"on the example batch, {e}; the first token mean is at{where}"
    except Exception:  # noqa: BLE001 - labels it cannot count here are counted on the ranks
        return None
    return None


def row_problem(model: nn.Module, example_inputs: Sequence[Any], loss_fn: Callable[..., torch.Tensor] | None,
                counter: TokenCounter | None, rows: int, *, gm: torch.fx.GraphModule | None = None,
                eval_path: str | None = None) -> str | None:
    """Why the loss is not the combination of its pieces' losses on ``rows``-row pieces of the
    example batch, or whose gradient is not (module docstring), or why that cannot be checked here
    (the model does not run on these rows, no rows of the batch count labels alike): a plan that
    cuts the batch is refused then too, since the runtime would combine the pieces on trust. None:
    it is. ``gm``, the model's capture, lets the message name a selection whose size depends on the
    data. ``eval_path``: where the model's eval mode parts from its training path
    (``fairscale.loss_check_mode``); the check then runs it in training mode, its draws constant.
    A model on meta is not checked (it is planned, never run: ``parallelize`` refuses it)."""
    batch = tuple(example_inputs)
    tensors = [t for t in batch if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors or any(p.is_meta for p in model.parameters()):
        return None
    have = min(t.shape[0] for t in tensors)
    if have < 2:
        return _unchecked(f"the example batch has {have} row", "give an example batch of at least 2 rows")
    rows = max(1, min(rows, have // 2))
    try:
        lo, weights = _window(counter, batch, rows)
    except ValueError as e:
        return _unchecked(str(e), "give an example batch with labels in every row")
    whole = batch_rows(batch, lo, lo + 2 * rows)
    pieces = [batch_rows(batch, lo, lo + rows), batch_rows(batch, lo + rows, lo + 2 * rows)]
    mode = "eval mode" if eval_path is None else \
        f"training mode, its random draws constant (its code takes another path in eval mode: {eval_path})"
    try:
        runs = run_batches(model, loss_fn, (whole, *pieces), training=eval_path is not None)
    except Exception as e:  # noqa: BLE001 - said in the refusal
        said = (str(e).strip().splitlines() or [""])[0][:300]
        return _unchecked(f"the model raised {type(e).__name__} on rows {lo}-{lo + 2 * rows - 1} of the example "
                          f"batch in {mode} ({said})", "make the model's forward run on them")
    got, want = runs[0][0], sum(w * v for w, (v, _) in zip(weights, runs[1:]) if w)
    if not math.isfinite(got):
        return _unchecked(f"the loss of rows {lo}-{lo + 2 * rows - 1} of the example batch is {got} in {mode}",
                          "give an example batch on which the model's loss is finite")
    full = torch.finfo(torch.promote_types(torch.float32, param_dtype(model))).bits >= 32
    tol, grad_tol = (1e-3, GRAD_TOL) if full else (5e-2, 5e-2)
    how = {None: "the mean of the pieces' losses", "mean": "the pieces' losses weighed by their labels",
           "sum": "the sum of the pieces' losses"}[None if counter is None or len(set(weights)) == 1 else counter.kind]
    span = f"rows {lo}-{lo + rows - 1}, {lo + rows}-{lo + 2 * rows - 1}"
    if not abs(got - want) <= tol * max(abs(got), abs(want)) + 1e-6:  # a piece's nan or inf differs too
        found = f"on the example batch, rows {lo}-{lo + 2 * rows - 1} give {got:.6g}, but {how} ({span}) is {want:.6g}"
    else:
        off = gradient_error(runs[0][1], [(w, g) for w, (_, g) in zip(weights, runs[1:])])
        if off is None or off <= grad_tol:
            return None
        found = f"on the example batch, rows {lo}-{lo + 2 * rows - 1} give {got:.6g} and {how} ({span}) {want:.6g}, "
        found += ("but a piece's gradient is not finite where the batch's is, or the other way round"
                  if math.isinf(off) else
                  f"but their gradients differ by {off:.2g} of a gradient's norm (a mean over a number of terms "
                  "that differs between the pieces, such as x[mask].mean() or (l * m).sum() / m.sum(), weighs them "
                  "alike while their terms are about equal, as at initialization; a term that couples the rows "
                  "with a small weight, such as a router's load-balancing loss, moves the loss little and its "
                  "parameters' gradients more)")
    drawn = _random_site(gm) if gm is not None else ""
    if drawn:
        return (f"the loss check cannot compare the batch with its pieces: the model draws random numbers in its "
                f"forward ({drawn}), so the batch and each piece draw other ones, and {found}. Whether the loss "
                "is computed row by row is not known. Pass the random values in as a batch input (a noise or mask "
                f"tensor with the batch's rows first, cut with the rows), or: {_KEEP_WHOLE}")
    if eval_path is not None:
        found += f" (run in {mode})"
    site = (_selection_site(gm) or _loss_site(gm, counter)) if gm is not None else ""
    return (f"the loss is not computed row by row: {found}. Cut into pieces (dp x microbatches), the step would "
            "train to other numbers: the loss couples the rows (in-batch negatives of a contrastive loss, a batch "
            "statistic, a product of batch means, a mean over a data-dependent selection) or sums over them by "
            f"hand.{site} {_KEEP_WHOLE}, or make the loss a mean over rows")


_KEEP_WHOLE = f"Use a plan that keeps the batch whole ({KEEP_BATCH_WHOLE})"


def _unchecked(why: str, remedy: str) -> str:
    """The refusal of a batch-cutting plan whose loss neither the proof on the graph
    (``planner.row_flow``) nor the eager check could judge, because ``why``."""
    return (f"the loss could not be checked to be computed row by row: the graph does not prove it "
            f"(planner.row_flow) and the eager check cannot judge it: {why}. Cut into pieces (dp x microbatches), the "
            f"step might train to other numbers. {_KEEP_WHOLE}, or {remedy}")


def _window(counter: TokenCounter | None, batch: tuple[Any, ...], rows: int) -> tuple[int, list[float]]:
    """The first row ``lo`` of the example batch from which two ``rows``-row pieces can be weighed
    as the runtime weighs them (:func:`_weights`), and their weights; ValueError (why) if none can."""
    n = min(t.shape[0] for t in batch if isinstance(t, torch.Tensor) and t.dim() > 0)
    why = ""
    for lo in range(0, n - 2 * rows + 1, rows):
        try:
            return lo, _weights(counter, [batch_rows(batch, lo, lo + rows), batch_rows(batch, lo + rows, lo + 2 * rows)])
        except ValueError as e:
            why = why or str(e)
    raise ValueError(f"no two adjacent {rows}-row pieces of the example batch can be weighed: {why}")


def _selection_site(gm: torch.fx.GraphModule) -> str:
    """`` It selects at module M, op O, source S.`` for the first op of ``gm`` whose output size
    depends on the data (``x[mask]``, ``masked_select``, ``nonzero``), or ''."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, torch.Tensor) and free_unbacked_symbols(val.shape):
            return f" The batch's rows are selected by the data at {_site(node)}."
    return ""


def _random_site(gm: torch.fx.GraphModule) -> str:
    """``module M, op O, source S`` of the first op of ``gm`` that draws random numbers the check's
    runs draw too (``multinomial``, ``randperm``, ...; not those it makes constant,
    ``fairscale.loss_check_mode.draws_constant``, nor attention with a dropout argument: off in
    eval mode, constant in training), or ''."""
    return next((_site(node) for node, detail in random_nodes(gm) if not detail and not draws_constant(node.target)),
                "")  # detail: a dropout probability, constant in training and off in eval mode


def _loss_site(gm: torch.fx.GraphModule, counter: TokenCounter | None) -> str:
    """`` The loss is computed at module M, op O, source S.`` for the first loss op ``counter``
    names (else the op that returns the loss), or ''."""
    ops = set(counter.loss.split(", ")) if counter is not None else set()
    node = next((n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) in ops), None)
    if node is None:
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        while isinstance(out, (tuple, list)) and out:
            out = out[0]
        node = out if isinstance(out, torch.fx.Node) and out.op == "call_function" else None
    return "" if node is None else f" The loss is computed at {_site(node)}."


def _site(node: torch.fx.Node) -> str:
    """``module M, op O, source S`` of ``node`` (no source where the capture kept none)."""
    line = source_line(node)
    return (f"module {node.meta.get(META_MODULE) or '<model top level>'}, op {node.target}"
            + (f", source {line}" if line else ""))


def _weights(counter: TokenCounter | None, pieces: list[tuple[Any, ...]]) -> list[float]:
    """The pieces' weights as the runtime makes the batch's loss from them: those of
    ``passes.loss_count.piece_weights``, as for one dp rank holding every piece. ValueError where
    there is no rule to check against: pieces it cannot weigh (a token mean or a sum beside other
    terms, or several token means, that count differently; class weights the model computes), no
    labels counted. Several token means that count alike in every piece (CLIP's two cross
    entropies over ``arange(rows)``) are averaged, as the runtime does, and checked."""
    if counter is None:
        return [1 / len(pieces)] * len(pieces)
    try:
        counts = counter.count_all(pieces)
    except Exception as e:  # noqa: BLE001 - said in the refusal
        raise ValueError(f"their labels cannot be counted ({type(e).__name__}: {e})") from e
    if counter.kind == "mean" and not any(c for n in counts for c in (n if isinstance(n, tuple) else (n,))):
        raise ValueError("they count no labels (every one ignored)")
    weights = piece_weights(counter, [counts], 0)
    return [1 / len(pieces)] * len(pieces) if weights is None else weights
