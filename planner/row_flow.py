"""Does each row of the batch reach the loss on its own? A proof on the captured graph, no run.

A step cut into pieces (dp slices, microbatches) is the batch's step only when every row's terms
depend on that row alone until the loss combines them (``fairscale.loss_check``). That check ran
the model eagerly on four rows of the example batch, forward and backward, which is most of what
planning costs on a real model (Hugging Face's GPT-2 with its default config and a batch of 8 ×
1024 tokens: 55 s of 63 s in ``fairscale.plan`` on two cores). :func:`rows_independent` proves
the same thing from the ATen graph alone, when it can, by following the batch's dimension
through every op::

    tokens (B, S)  ─embedding─►  (B, S, D)  ─linear, attention, norm─►  (B, S, V)
        ─view(-1, V)─►  (B·S, V)  rows in blocks of S  ─cross_entropy (mean)─►  loss

A value's state is :class:`Rows` (``dim`` holds the batch: index ``i`` belongs to row
``i // block``, and every element depends on its row and on no other), ``None`` (the same whatever
the batch: parameters, constants, their functions) or :class:`Reduced` (a mean over all rows,
allowed only in a linear combination at the end). An op without a rule here, or one that mixes
rows (a reduction over the batch's dimension, ``a @ b.T`` of two batch values, a slice or an index
along it, an in-place op whose write another reader may see), ends the proof: the answer is then
"not proven" and the eager check decides, so a gap here costs time, never a wrong answer. Only two shapes of loss are proven, the
two the runtime combines exactly without counting anything else:

* **a token mean**: the graph's output is one ``cross_entropy`` / ``nll_loss`` with reduction mean
  over values whose rows are the batch's (``passes.loss_weights.token_counter`` then weighs the
  pieces by their labels);
* **means**: the output is a linear combination, with constant coefficients, of full means
  (``x.mean()``, ``mse_loss``) of row-wise values, each piece's mean over its equal share of rows.

Sums over the batch, several token means, batch norm in training: not proven here (the eager check
and ``passes.loss_count`` judge them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

import operator

from planner.graph import past_value_keeping
from planner.row_rules import (COMPUTE_RULES, NOOP, POINTWISE, TOKEN_KEY, Reduced, Rows, Rule, State, Unproven,
                               along_dims, args, op_name, pointwise, shape_of)
from planner.row_shapes import SHAPE_RULES

__all__ = ["Rows", "Reduced", "rows_independent", "row_states", "same_but_rows", "live_nodes", "scans_over_rows",
           "MOVES"]


def rows_independent(gm: torch.fx.GraphModule, *, token_mean: bool) -> bool:
    """Whether every row of the batch reaches ``gm``'s loss on its own and the loss combines the rows
    as the runtime combines pieces (module docstring): ``token_mean`` when the loss is one token
    mean (``passes.loss_weights.token_counter`` found it, ``exact``), else a linear combination of
    means. False means not proven (the eager check then decides), never "coupled"."""
    try:
        states = row_states(gm)
    except Exception:  # noqa: BLE001 - an op without a rule, or one this module misreads: not proven
        return False
    out = next(n for n in gm.graph.nodes if n.op == "output")
    value = out.args[0]
    while isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.fx.Node):
        return False
    if token_mean:  # the token mean the counter found, past the casts and views it looked through
        return bool(states.get(TOKEN_KEY) == past_value_keeping(value).name)
    return isinstance(states.get(value.name), Reduced) and TOKEN_KEY not in states


def live_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes the output depends on, in graph order: the output's ancestors and every in-place
    op's (whose write another reader may see), with the in-place ops. Hugging Face's models leave
    dead ops behind (``torch.arange(batch_size)`` unsqueezed for a mask function nothing calls)."""
    roots = [n for n in gm.graph.nodes if n.op == "output"
             or n.op == "call_function" and op_name(n).endswith("_") and not op_name(n).startswith("_")]
    seen: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return [n for n in gm.graph.nodes if n in seen]


def row_states(gm: torch.fx.GraphModule) -> dict[str, State]:
    """Node name -> state (module docstring), for every live node (:func:`live_nodes`); raises
    :class:`planner.row_rules.Unproven` at the first op that mixes rows or has no rule. The batch
    is every placeholder holding a tensor of one or more dims (the runtime slices dim 0 of each)."""
    states: dict[str, State] = {}
    for node in live_nodes(gm):
        if node.op == "placeholder":
            val = node.meta.get("val")
            states[node.name] = Rows(0) if isinstance(val, torch.Tensor) and val.dim() > 0 else None
        elif node.op == "get_attr":
            states[node.name] = None
        elif node.op == "call_function":
            states[node.name] = op_state(node, states)
        elif node.op == "output":
            continue
        else:  # call_module / call_method: not an ATen graph
            raise Unproven(node, f"{node.op} has no rule (an ATen graph from torch.export is analysed)")
    return states


# --- two captures ----------------------------------------------------------------------------------


_SIZE_ARG = {"view": 1, "reshape": 1, "_unsafe_view": 1, "expand": 1, "unflatten": 2, "ones": 0, "zeros": 0,
             "full": 0, "new_ones": 1, "new_zeros": 1, "new_full": 1}
"""Op -> the position of its size argument, whose ints may scale with the batch between two captures
(nothing else of the node may differ: ``full(size, fill)``'s fill must not)."""


def same_but_rows(a: torch.fx.GraphModule, b: torch.fx.GraphModule, rows_a: int, rows_b: int) -> str | None:
    """Why ``a`` (captured on ``rows_a`` rows) and ``b`` (on ``rows_b``) are not one graph up to the
    batch's size, or None when they are: the same ops on the same values, where the only constants
    that differ are sizes of reshapes and expands that scale with the rows. A constant that follows
    the batch's size elsewhere (``x * x.shape[0]``, ``torch.arange(len(x))``, a branch on it) is
    invisible in one capture, which is why :func:`rows_independent`'s proof needs both."""
    nodes_a, nodes_b = live_nodes(a), live_nodes(b)
    if len(nodes_a) != len(nodes_b):
        return f"{len(nodes_a)} nodes on {rows_a} rows, {len(nodes_b)} on {rows_b}"
    index_a = {n.name: i for i, n in enumerate(nodes_a)}
    index_b = {n.name: i for i, n in enumerate(nodes_b)}

    def same(x: Any, y: Any, scales: bool) -> bool:
        if isinstance(x, torch.fx.Node) or isinstance(y, torch.fx.Node):
            return isinstance(x, torch.fx.Node) and isinstance(y, torch.fx.Node) \
                and index_a.get(x.name) == index_b.get(y.name)
        if isinstance(x, (list, tuple)) or isinstance(y, (list, tuple)):
            return isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y) \
                and all(same(u, v, scales) for u, v in zip(x, y))
        if type(x) is not type(y):
            return False
        if isinstance(x, int) and not isinstance(x, bool) and x != y:
            return scales and x > 0 and x * rows_b == y * rows_a
        return bool(x == y) or (isinstance(x, float) and x != x and y != y)

    for x, y in zip(nodes_a, nodes_b):
        at = _SIZE_ARG.get(op_name(x), -1) if x.op == "call_function" else -1
        if (x.op, x.target) != (y.op, y.target) or x.kwargs.keys() != y.kwargs.keys() \
                or len(x.args) != len(y.args) \
                or not all(same(u, v, i == at) for i, (u, v) in enumerate(zip(x.args, y.args))) \
                or not all(same(x.kwargs[k], y.kwargs[k], k == "size") for k in x.kwargs):
            return f"{x.format_node()} on {rows_a} rows is {y.format_node()} on {rows_b}"
    return None


SCANS = {"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"}
"""Prefix scans: element ``i`` of the result depends on every element before it along the dim."""


MOVES = {"roll", "flip"}
"""Ops that move each element to another index along their dims: along a dim that holds the
batch's rows, a row takes other rows' values (a roll of a seq-first tensor's batch dim, a token
shift over the flattened batch), and a piece of the batch moves its own rows' values otherwise."""


def scans_over_rows(a: torch.fx.GraphModule, b: torch.fx.GraphModule, rows_a: int, rows_b: int, *,
                    ops: set[str] = SCANS) -> list[torch.fx.Node]:
    """The live scans of ``a`` (captured on ``rows_a`` rows; ``b``, the same code on ``rows_b``) along a
    dim whose size grows with the rows: a dim that holds the batch's rows, so that a row's result
    depends on the rows before it. DeepSpeed's and fairseq's MoE gates number every token of the
    batch this way to drop those past an expert's capacity (``torch.cumsum(mask, dim=0)`` over the
    flattened tokens): a piece of the batch numbers its own tokens and keeps others. Whether it
    changes a loss depends on the data (no token is dropped while the experts are balanced, as at
    initialization), so no run on an example batch can vouch for it. Matched by node name and op.
    ``ops``: :data:`MOVES` finds rolls and flips along such a dim (a hinge loss that is 0 on the rows
    they move in the example batch hides them from the eager check too)."""
    in_b = {n.name: n for n in live_nodes(b)}
    found = []
    for node in live_nodes(a):
        other = in_b.get(node.name)
        if node.op != "call_function" or op_name(node) not in ops or other is None or other.target != node.target:
            continue
        x, y = args(node)[0], args(other)[0]
        if not isinstance(x, torch.fx.Node) or not isinstance(y, torch.fx.Node):
            continue
        try:
            shape_a, shape_b = shape_of(x), shape_of(y)
            dims = along_dims(node)
        except KeyError:
            continue
        if len(shape_a) != len(shape_b) or not shape_a:
            continue
        dims = set(range(len(shape_a))) if dims is None else dims  # roll without dims: the whole tensor flattened
        if any(shape_a[d] != shape_b[d] and shape_a[d] * rows_b == shape_b[d] * rows_a for d in dims):
            found.append(node)
    return found


_RULES: dict[str, Rule] = {**COMPUTE_RULES, **SHAPE_RULES}
assert not set(_RULES) & POINTWISE, "an op is elementwise or has its own rule, not both"


def op_state(node: torch.fx.Node, states: dict[str, State]) -> State:
    if node.target is operator.getitem:
        whole = states[_first(node).name]
        if whole is None:
            return None
        if isinstance(whole, tuple):
            return whole[args(node)[1]]
        raise Unproven(node, "getitem of a single value")
    inputs = [states[n.name] for n in node.all_input_nodes]
    if all(s is None for s in inputs):
        return None  # a function of the parameters and constants alone, whatever the op
    name = op_name(node)
    if name in NOOP:
        return inputs[0] if name == "detach_" else None
    if node.op == "call_function" and name.endswith("_") and not name.startswith("_"):
        if not _sole_fresh_reader(node):
            raise Unproven(node, "an in-place op whose write another reader may see")
        name = name[:-1]  # on a fresh value nothing else reads, it is its functional op
    rule = _RULES.get(name)
    if rule is None:
        if name in POINTWISE:
            return pointwise(node, states, name)
        raise Unproven(node, f"no rule for {name}")
    return rule(node, states)


_MAY_ALIAS = {"view", "reshape", "_unsafe_view", "transpose", "permute", "t", "slice", "select", "narrow", "expand",
              "unsqueeze", "squeeze", "alias", "detach", "split", "chunk", "unflatten", "flatten", "as_strided",
              "diagonal", "unbind", "contiguous", "to", "type_as", "view_as", "expand_as", "reshape_as"}
"""Ops whose output may share its input's storage: an in-place write to it writes the input too."""


def _sole_fresh_reader(node: torch.fx.Node) -> bool:
    """Whether in-place ``node`` writes a value only it reads, computed into storage of its own (not
    a view, a parameter or an input): then no other reader sees the write (``relu_`` after a norm,
    ``out += identity``)."""
    target = node.args[0] if node.args else None
    return isinstance(target, torch.fx.Node) and target.op == "call_function" and len(target.users) == 1 \
        and target.target is not operator.getitem and op_name(target) not in _MAY_ALIAS


def _first(node: torch.fx.Node) -> torch.fx.Node:
    arg = node.args[0]
    if not isinstance(arg, torch.fx.Node):
        raise Unproven(node, "getitem of a constant")
    return arg
