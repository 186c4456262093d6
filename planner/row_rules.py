"""The rules of :mod:`planner.row_flow`: each ATen op's state from its inputs' states.

A state is :class:`Rows` (``dim`` holds the batch: index ``i`` belongs to row ``i // block``, and
every element depends on its row and on no other), ``None`` (the same whatever the batch) or
:class:`Reduced` (a mean over every row), or a tuple of states for an op with several outputs.
A rule raises :class:`Unproven` where the op mixes rows or where this module does not know it:
the proof then stops, and the eager check decides. Adding an op means adding its rule here and its
case to ``tests/planner/test_row_flow.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx

__all__ = ["Rows", "Reduced", "Unproven", "State", "Rule", "TOKEN_KEY", "POINTWISE", "NOOP", "COMPUTE_RULES",
           "pointwise", "op_name", "same_as_first", "rows_of", "shape_of", "state_of", "args", "kwargs_of", "norm_dim",
           "broadcast_free"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Rows:
    """Dim ``dim`` holds the batch: index ``i`` belongs to row ``i // block``."""

    dim: int
    block: int = 1


@dataclass(frozen=True)
class Reduced:
    """A mean over every row (one number per step)."""

    kind: str = "mean"


class Unproven(Exception):
    """The op at ``node`` has no rule here, or mixes rows."""

    def __init__(self, node: torch.fx.Node, why: str) -> None:
        super().__init__(f"{node.format_node()}: {why}")


State = Any  # Rows | Reduced | None | tuple of states (an op with several outputs)

POINTWISE = {
    "add", "sub", "rsub", "mul", "div", "pow", "neg", "tanh", "silu", "gelu", "relu", "sigmoid", "rsqrt", "sqrt",
    "exp", "log", "abs", "where", "le", "lt", "ge", "gt", "eq", "ne", "masked_fill", "clamp", "clamp_min",
    "clamp_max", "to", "_to_copy", "clone", "contiguous", "alias", "dropout", "logical_not",
    "logical_and", "logical_or", "maximum", "minimum", "erf", "cos", "sin", "reciprocal", "square", "log1p",
    "expm1", "softplus", "hardtanh", "leaky_relu", "elu", "mish", "hardswish", "hardsigmoid", "relu6",
    "bitwise_and", "bitwise_or", "bitwise_not", "lerp", "detach", "lift_fresh_copy", "_assert_tensor_metadata",
    "fill", "zeros_like", "ones_like", "full_like", "empty_like", "floor_divide", "remainder", "sign", "atan",
}
"""Elementwise ops (with broadcasting): each output element reads the same position of each input."""
_LINEAR_IN_REDUCED = {"add", "sub", "rsub", "neg", "to", "_to_copy", "clone", "alias", "contiguous"}
_SCALES_REDUCED = {"mul", "div"}
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"}
_REDUCE = {"sum.dim_IntList", "mean.dim", "mean.default", "amax.default", "amin.default", "max.dim", "min.dim",
           "var.correction", "std.correction", "logsumexp.default", "argmax.default", "argmin.default", "any.dim",
           "all.dim", "prod.dim_int", "var.dim", "std.dim", "var_mean.correction", "std_mean.correction",
           "sum.default", "max.default", "min.default"}
"""Reductions by overload (``packet.overload``): argument 1 is the dims (an int, a list, or absent
for all), ``keepdim`` argument 2 or a keyword. Other overloads (``var(x, unbiased)``, ``norm(x, p,
dim)``, ``max(a, b)``) put something else there and have no rule."""
_MEANS = {"mean", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy_with_logits",
          "binary_cross_entropy", "soft_margin_loss"}
"""Losses whose ``reduction`` argument (position 2, or ``mean`` itself) averages every element."""
_TOKEN_MEANS = {"cross_entropy_loss", "nll_loss", "nll_loss_nd"}
NOOP = {"detach_", "_assert_tensor_metadata"}
TOKEN_KEY = "<token mean>"
"""Where :func:`op_state` records the node of the loss's token mean (one per graph)."""


def op_name(node: torch.fx.Node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None and getattr(target, "namespace", "") == "aten":
        return str(packet.__name__)
    return f"<{target}>"  # not an ATen op: never matches a rule


def args(node: torch.fx.Node) -> tuple[Any, ...]:
    return tuple(node.args)


def kwargs_of(node: torch.fx.Node) -> dict[str, Any]:
    return dict(node.kwargs)


def _arg_node(node: torch.fx.Node, i: int) -> torch.fx.Node:
    arg = args(node)[i]
    if not isinstance(arg, torch.fx.Node):
        raise Unproven(node, f"argument {i} is not a value")
    return arg


def shape_of(node: Any) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape)
    if isinstance(val, (int, float, bool)):
        return ()
    raise KeyError("no shape")


def state_of(arg: Any, states: dict[str, State]) -> State:
    return states[arg.name] if isinstance(arg, torch.fx.Node) else None


def rows_of(node: torch.fx.Node, arg: Any, states: dict[str, State]) -> Rows | None:
    """``arg``'s Rows, None when it does not depend on the batch; a Reduced or several outputs end the proof."""
    state = state_of(arg, states)
    if state is None or isinstance(state, Rows):
        return state
    raise Unproven(node, f"{getattr(arg, 'name', arg)} is {state} here")


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


# --- elementwise ---------------------------------------------------------------------------------


def pointwise(node: torch.fx.Node, states: dict[str, State], name: str) -> State:
    tensors = [a for a in _flat_args(node) if isinstance(a, torch.fx.Node)]
    kinds = [state_of(a, states) for a in tensors]
    if any(isinstance(k, Reduced) for k in kinds):
        return _reduced_arithmetic(node, states, name, tensors, kinds)
    return _aligned(node, states, tensors, shape_of(node))


def _aligned(node: torch.fx.Node, states: dict[str, State], tensors: Sequence[torch.fx.Node],
             out: tuple[int, ...]) -> Rows:
    """The Rows of an elementwise result of shape ``out`` from ``tensors`` broadcast together: every
    input holding the batch holds it in the same dim of the result, unbroadcast, and every
    batch-free input is constant along that dim (size 1 or absent there: one that varies along it
    gives row i its i-th slice, which a piece of the batch would not get)."""
    found: Rows | None = None
    for arg in tensors:
        kind = rows_of(node, arg, states)
        if kind is None:
            continue
        shape = shape_of(arg)
        at = kind.dim + len(out) - len(shape)
        if shape[kind.dim] != out[at]:
            raise Unproven(node, f"{arg.name}'s batch dim {kind.dim} is broadcast")
        here = Rows(at, kind.block)
        if found is not None and found != here:
            raise Unproven(node, f"the inputs hold the batch in different dims ({found}, {here})")
        found = here
    if found is None:
        raise Unproven(node, "no input holds the batch")
    for arg in tensors:
        if state_of(arg, states) is None and not broadcast_free(arg, found.dim, len(out)):
            raise Unproven(node, f"{arg.name} does not depend on the batch but varies along its dim")
    return found


def _reduced_arithmetic(node: torch.fx.Node, states: dict[str, State], name: str, tensors: list[torch.fx.Node],
                        kinds: list[State]) -> State:
    """A mean over the rows, taken on: sums and differences of means, and means scaled by a
    batch-free number, are what the runtime's mean of pieces reproduces; nothing else is."""
    if any(isinstance(k, Rows) for k in kinds) or any(isinstance(k, tuple) for k in kinds):
        raise Unproven(node, "a mean over the rows meets per-row values (the loss couples the rows)")
    if name in _LINEAR_IN_REDUCED:
        if name in ("add", "sub", "rsub") and any(k is None and shape_of(t) not in ((), (1,))
                                                   for t, k in zip(tensors, kinds)):
            raise Unproven(node, "a mean over the rows added to a batch-free tensor")
        return Reduced()
    if name in _SCALES_REDUCED:
        reduced = [i for i, a in enumerate(args(node)[:2]) if isinstance(state_of(a, states), Reduced)]
        if reduced == [0] or (name == "mul" and reduced == [1]):
            return Reduced()
    raise Unproven(node, f"{name} of a mean over the rows is not linear in it")


def _flat_args(node: torch.fx.Node) -> list[Any]:
    out: list[Any] = []
    for a in (*args(node), *kwargs_of(node).values()):
        out.extend(a if isinstance(a, (list, tuple)) else [a])
    return out


# --- the rules -------------------------------------------------------------------------------------


def same_as_first(node: torch.fx.Node, states: dict[str, State]) -> State:
    rows = rows_of(node, args(node)[0], states)
    others = [a for a in _flat_args(node)[1:] if isinstance(a, torch.fx.Node) and state_of(a, states) is not None]
    if others:
        raise Unproven(node, f"{others[0].name} holds the batch too")
    return rows


def _linear(node: torch.fx.Node, states: dict[str, State]) -> State:
    rows = same_as_first(node, states)
    if rows is not None and rows.dim == len(shape_of(args(node)[0])) - 1:
        raise Unproven(node, "the batch's dim is contracted")
    return rows


def _addmm(node: torch.fx.Node, states: dict[str, State]) -> State:
    bias, a, b = (state_of(x, states) for x in args(node)[:3])
    if bias is None and b is None and isinstance(a, Rows) and a.dim == 0:
        return a
    raise Unproven(node, "addmm with the batch outside its first matrix's rows")


def _matmul(node: torch.fx.Node, states: dict[str, State]) -> State:
    a, b = (rows_of(node, x, states) for x in args(node)[:2])
    sa, sb, out = shape_of(args(node)[0]), shape_of(args(node)[1]), shape_of(node)
    if len(sa) < 2 or len(sb) < 2:
        raise Unproven(node, "a matrix-vector product")
    found: list[Rows] = []
    for rows, shape, is_b in ((a, sa, False), (b, sb, True)):
        if rows is None:
            continue
        if is_b and rows.dim == len(shape) - 1:
            found.append(Rows(len(out) - 1, rows.block))  # b's columns: the output's columns
        elif not is_b and rows.dim == len(shape) - 2:
            found.append(Rows(len(out) - 2, rows.block))  # a's rows: the output's rows
        elif rows.dim < len(shape) - 2:
            found.append(Rows(rows.dim + len(out) - len(shape), rows.block))  # a batch dim of the product
        else:
            raise Unproven(node, "the batch's dim is contracted")
    if len(found) == 2 and (found[0] != found[1] or found[0].dim >= len(out) - 2):
        raise Unproven(node, "both factors hold the batch (a @ b.T of two batch values couples their rows)")
    here = found[0]
    for rows, shape in ((a, sa), (b, sb)):  # a batch-free factor broadcast along the batch's dim
        at = here.dim - (len(out) - len(shape))
        if rows is None and here.dim < len(out) - 2 and 0 <= at and shape[at] != 1:
            raise Unproven(node, "a batch-free factor varies along the batch's dim")
    return here


def _embedding(node: torch.fx.Node, states: dict[str, State]) -> State:
    if state_of(args(node)[0], states) is not None:
        raise Unproven(node, "an embedding table that depends on the batch")
    return rows_of(node, args(node)[1], states)


def _last_dims_free(count: Callable[[torch.fx.Node], int]) -> Callable[[torch.fx.Node, dict[str, State]], State]:
    """Ops that mix the last ``count(node)`` dims of their first input (norms, softmax)."""
    def rule(node: torch.fx.Node, states: dict[str, State]) -> State:
        rows = same_as_first(node, states)
        ndim = len(shape_of(args(node)[0]))
        if rows is not None and rows.dim >= ndim - count(node):
            raise Unproven(node, "it normalizes across the batch's dim")
        return rows
    return rule


def _native_layer_norm(node: torch.fx.Node, states: dict[str, State]) -> State:
    rows = _last_dims_free(lambda n: len(args(n)[1]))(node, states)
    return (rows, rows, rows)


def _softmax(node: torch.fx.Node, states: dict[str, State]) -> State:
    rows = same_as_first(node, states)
    if rows is not None and norm_dim(int(args(node)[1]), len(shape_of(args(node)[0]))) == rows.dim:
        raise Unproven(node, "a softmax over the batch's dim")
    return rows


ALONG: dict[str, tuple[int, int | None]] = {
    **{name: (1, None) for name in ("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "flip")},
    "sort": (1, -1), "argsort": (1, -1), "topk": (2, -1), "kthvalue": (2, -1), "roll": (2, None),
}
"""Ops along some dims of their first input (scans, sorts, top-k, flip, roll): the argument that
gives the dims (or ``dim``/``dims``), and the default dim."""


def along_dims(node: torch.fx.Node) -> set[int] | None:
    """The dims of ``node``'s first input that an :data:`ALONG` op works along; None where it gives
    none (``roll`` without dims flattens its input)."""
    at, default = ALONG[op_name(node)]
    given: Any = args(node)[at] if len(args(node)) > at else kwargs_of(node).get("dim", kwargs_of(node).get("dims"))
    if given is None:
        given = [] if default is None else default
    dims = list(given) if isinstance(given, (list, tuple)) else [given]
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return None
    return {norm_dim(d, len(shape_of(args(node)[0]))) for d in dims}


def _along(node: torch.fx.Node, states: dict[str, State]) -> State:
    """An :data:`ALONG` op: row by row unless one of its dims holds the batch."""
    rows = same_as_first(node, states)
    dims = along_dims(node)
    if dims is None:
        raise Unproven(node, "no dim given (the input flattened)")
    if rows is not None and rows.dim in dims:
        raise Unproven(node, f"{op_name(node)} along the batch's dim")
    return tuple(rows for _ in node.meta["val"]) if isinstance(node.meta.get("val"), (tuple, list)) else rows


def _einsum(node: torch.fx.Node, states: dict[str, State]) -> State:
    """``einsum(equation, operands)`` with an explicit output: row by row where every operand that
    holds the batch holds it at one letter (one block), which the output keeps and no batch-free
    operand has (``bhid,bhjd->bhij``); a contraction over it, or an ellipsis, is not proven."""
    equation, operands = args(node)[0], args(node)[1]
    terms, _, out = str(equation).replace(" ", "").partition("->")
    inputs = terms.split(",")
    if not out and "->" not in str(equation) or "." in terms + out or len(inputs) != len(operands):
        raise Unproven(node, "an einsum with an ellipsis or without its output's letters")
    held = {(term[r.dim], r.block) for term, x in zip(inputs, operands) if (r := rows_of(node, x, states))}
    if len(held) != 1:
        raise Unproven(node, "operands hold the batch at different letters")
    (letter, block), = held
    if letter not in out or any(letter in term for term, x in zip(inputs, operands) if state_of(x, states) is None):
        raise Unproven(node, "the batch's letter is contracted or met by a batch-free operand")
    return Rows(out.index(letter), block)


def _reduce(node: torch.fx.Node, states: dict[str, State]) -> State:
    name = op_name(node)
    overload = f"{name}.{getattr(node.target, '_overloadname', '')}"
    if overload not in _REDUCE:
        raise Unproven(node, "no rule for this overload")
    rows = same_as_first(node, states)
    assert rows is not None
    ndim = len(shape_of(args(node)[0]))
    dims_arg = args(node)[1] if len(args(node)) > 1 else kwargs_of(node).get("dim")
    if isinstance(dims_arg, bool):
        raise Unproven(node, "a flag where the dims go")
    if isinstance(dims_arg, int):
        dims = {norm_dim(dims_arg, ndim)}
    elif isinstance(dims_arg, (list, tuple)) and dims_arg:
        dims = {norm_dim(int(d), ndim) for d in dims_arg}
    else:
        dims = set(range(ndim))
    at = 3 if overload in ("var.dim", "std.dim") else 2  # (self, dim, unbiased, keepdim) there
    keepdim = bool(args(node)[at] if len(args(node)) > at else kwargs_of(node).get("keepdim", False))
    if rows.dim not in dims:
        kept = rows.dim if keepdim else rows.dim - sum(1 for d in dims if d < rows.dim)
        here = Rows(kept, rows.block)
        return (here, here) if isinstance(node.meta.get("val"), (tuple, list)) else here
    if name == "mean" and dims == set(range(ndim)):
        return Reduced()
    raise Unproven(node, f"{name} over the batch's dim")


def _mean_loss(node: torch.fx.Node, states: dict[str, State]) -> State:
    """Elementwise losses (input and target alike in shape); ``reduction`` 1 averages every element."""
    name = op_name(node)
    extra = {"binary_cross_entropy": 1, "binary_cross_entropy_with_logits": 2}.get(name, 0)  # weights first
    weights = [a for a in args(node)[2:2 + extra] if isinstance(a, torch.fx.Node)]
    at = 2 + extra
    reduction = args(node)[at] if len(args(node)) > at else kwargs_of(node).get("reduction", 1)
    inputs = [a for a in args(node)[:2] if isinstance(a, torch.fx.Node)] + weights
    rows = _aligned(node, states, inputs, shape_of(args(node)[0]))
    if reduction == 1:
        return Reduced()
    if reduction == 0:
        return rows
    raise Unproven(node, "a sum over the rows")


def _token_mean(node: torch.fx.Node, states: dict[str, State]) -> State:
    logits, labels = (rows_of(node, a, states) for a in args(node)[:2])
    weight = args(node)[2] if len(args(node)) > 2 else kwargs_of(node).get("weight")
    reduction = args(node)[3] if len(args(node)) > 3 else kwargs_of(node).get("reduction", 1)
    if logits is None or logits != labels or logits.dim != 0 or state_of(weight, states) is not None:
        raise Unproven(node, "a token mean whose logits and labels are not the batch's rows alike")
    if reduction == 0:
        return logits
    if reduction == 1 and TOKEN_KEY not in states:
        states[TOKEN_KEY] = node.name
        return Reduced("token mean")
    raise Unproven(node, "a sum, or a second token mean")


def _sdpa(node: torch.fx.Node, states: dict[str, State]) -> State:
    q, k, v = (rows_of(node, a, states) for a in args(node)[:3])
    mask = args(node)[3] if len(args(node)) > 3 else kwargs_of(node).get("attn_mask")
    ndim = len(shape_of(args(node)[0]))
    if q is None or q != k or q != v or q.dim >= ndim - 2:
        raise Unproven(node, "attention whose query, key and value hold the batch differently")
    sizes = {shape_of(a)[q.dim] for a in args(node)[:3]}
    gqa = args(node)[7] if len(args(node)) > 7 else kwargs_of(node).get("enable_gqa", False)
    if len(sizes) != 1 or (gqa and q.dim == ndim - 3):
        raise Unproven(node, "query, key and value differ along the batch's dim")
    m = rows_of(node, mask, states) if isinstance(mask, torch.fx.Node) else None
    if m is not None and m.block == q.block and m.dim + ndim - len(shape_of(mask)) == q.dim \
            and shape_of(mask)[m.dim] in sizes:
        return q
    if m is None and (not isinstance(mask, torch.fx.Node) or broadcast_free(mask, q.dim, ndim)):
        return q
    raise Unproven(node, "an attention mask that holds the batch elsewhere, or varies along it")


def broadcast_free(arg: torch.fx.Node, dim: int, ndim: int) -> bool:
    """Whether batch-free ``arg``, broadcast to ``ndim`` dims, is the same all along ``dim``: absent
    or of size 1 there, filled with one value, expanded from size 1 there (a causal mask expanded
    to the batch's size), or computed from such values by ops that work position by position along
    ``dim``: elementwise ones but random ones, and scans, sorts and the like along other dims (OPT's
    positions, a cumsum of ones the batch's size)."""
    shape = shape_of(arg)
    at = dim - (ndim - len(shape))
    if not (0 <= at < len(shape)) or shape[at] == 1:
        return True
    name = op_name(arg) if arg.op == "call_function" else ""
    if name in _UNIFORM:
        return True
    tensors = [a for a in _flat_args(arg) if isinstance(a, torch.fx.Node)] if name else []
    if name == "embedding" and at < len(shape) - 1:  # ids constant along a dim: their rows too
        return isinstance(args(arg)[1], torch.fx.Node) and broadcast_free(args(arg)[1], at, len(shape) - 1)
    if name == "expand":  # expand adds leading dims: align from the right
        source = args(arg)[0]
        inner = at - (len(shape) - len(shape_of(source)))
        return inner < 0 or broadcast_free(source, inner, len(shape_of(source)))
    if name == "unsqueeze":  # at is not the new dim: that has size 1
        return broadcast_free(args(arg)[0], at - (at > norm_dim(args(arg)[1], len(shape))), len(shape) - 1)
    if name in _KEEPS or (name in ALONG and at not in (along_dims(arg) or {at})):
        return bool(tensors) and tensors[0] is args(arg)[0] and broadcast_free(tensors[0], at, len(shape))
    if name in POINTWISE and name not in _RANDOM:
        return bool(tensors) and all(broadcast_free(t, at, len(shape)) for t in tensors)
    return False


_RANDOM = {"dropout"}
"""Elementwise ops that draw a random number per element."""
_UNIFORM = {"ones", "zeros", "full", "new_ones", "new_zeros", "new_full", "ones_like", "zeros_like", "full_like",
            "scalar_tensor"}
"""Ops that fill every element with one value."""
_KEEPS = {"expand", "to", "_to_copy", "clone", "contiguous", "alias", "detach"}
"""Ops whose output holds its input's values where the input's dims are kept (for :func:`broadcast_free`)."""


def _broadcast_tensors(node: torch.fx.Node, states: dict[str, State]) -> State:
    """``broadcast_tensors`` (``F.mse_loss`` and friends call it): each output as the elementwise rule
    aligns it."""
    vals = node.meta.get("val")
    if not isinstance(vals, (list, tuple)) or not vals:
        raise Unproven(node, "no shapes recorded")
    parts = [a for a in args(node)[0] if isinstance(a, torch.fx.Node)]
    rows = _aligned(node, states, parts, tuple(int(n) for n in vals[0].shape))
    return tuple(rows for _ in vals)


def _per_sample(spatial: int, mixes_channels: bool) -> Rule:
    """Ops on (N, C, *spatial) inputs that act on each sample alone: convolutions (which mix the
    channels too, so they need the batched form) and pools (which need only the batch's dim
    outside the ``spatial`` dims they pool)."""
    def rule(node: torch.fx.Node, states: dict[str, State]) -> State:
        rows = same_as_first(node, states)
        ndim = len(shape_of(args(node)[0]))
        if rows is None:
            return None
        if (rows.dim != 0 or ndim != spatial + 2) if mixes_channels else rows.dim >= ndim - spatial:
            raise Unproven(node, "the batch's dim is among the dims it mixes")
        return (rows, rows) if isinstance(node.meta.get("val"), (list, tuple)) else rows
    return rule


def _type_as(node: torch.fx.Node, states: dict[str, State]) -> State:
    """``type_as(self, other)``: ``self``'s values in ``other``'s dtype (``other``'s values unread)."""
    return state_of(args(node)[0], states)


def _group_norm(node: torch.fx.Node, states: dict[str, State]) -> State:
    rows = same_as_first(node, states)
    if rows is not None and rows.dim != 0:
        raise Unproven(node, "group norm normalizes across the batch's dim")
    return (rows, rows, rows) if isinstance(node.meta.get("val"), (list, tuple)) else rows


Rule = Callable[[torch.fx.Node, dict[str, State]], State]

COMPUTE_RULES: dict[str, Rule] = {
    "linear": _linear, "addmm": _addmm, "mm": _matmul, "bmm": _matmul, "matmul": _matmul, "embedding": _embedding,
    "layer_norm": _last_dims_free(lambda n: len(args(n)[1])), "rms_norm": _last_dims_free(lambda n: len(args(n)[1])),
    "native_layer_norm": _native_layer_norm,
    "scaled_dot_product_attention": _sdpa, "cross_entropy_loss": _token_mean, "nll_loss": _token_mean,
    "nll_loss_nd": _token_mean, "broadcast_tensors": _broadcast_tensors,
    "conv1d": _per_sample(1, True), "conv2d": _per_sample(2, True), "conv3d": _per_sample(3, True),
    "conv_transpose1d": _per_sample(1, True), "conv_transpose2d": _per_sample(2, True),
    "conv_transpose3d": _per_sample(3, True),
    "max_pool1d": _per_sample(1, False), "max_pool2d": _per_sample(2, False), "max_pool3d": _per_sample(3, False),
    "avg_pool1d": _per_sample(1, False), "avg_pool2d": _per_sample(2, False), "avg_pool3d": _per_sample(3, False),
    "max_pool2d_with_indices": _per_sample(2, False), "adaptive_avg_pool1d": _per_sample(1, False),
    "adaptive_avg_pool2d": _per_sample(2, False), "adaptive_max_pool2d": _per_sample(2, False),
    "upsample_nearest2d": _per_sample(2, False), "upsample_bilinear2d": _per_sample(2, False),
    "group_norm": _group_norm, "native_group_norm": _group_norm, "type_as": _type_as,
    **{name: _softmax for name in _SOFTMAX},
    **{name: _along for name in ALONG}, "einsum": _einsum,
    **{name.split(".")[0]: _reduce for name in _REDUCE},
    **{name: _mean_loss for name in _MEANS if name != "mean"},
}
"""ATen op (its overload packet's name) -> its rule, for the ops that compute; elementwise ops
(:data:`POINTWISE`) share :func:`pointwise`."""
