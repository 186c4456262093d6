"""Generic per-op sharding rules of ``shard_tensor_parallel_pass`` (model ops and the op table are in
``passes.tp.model_rules``): which placements an aten op can compute
on, what placement its output has, and how its constant arguments change for local shapes.

Every rule takes the :class:`~passes.tp.rewrite.Rewriter` and the old node, emits the new node(s)
and returns ``(new_node, placement)``. An op without a rule runs on replicated inputs (shards are
gathered, partial sums reduced), which is always correct; a sharded *parameter* reaching such an
op is an error instead, since gathering a weight every step would silently undo the plan.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.fx import Node

from passes.ops import tp_ops
from passes.tp.placement import PD, P, Placement, R, S
from passes.tp.functionalize import is_inplace
from passes.tp.rewrite import META_TP_FALLBACK, Rewriter, TPShardError, args_of, fmt

aten = torch.ops.aten
Rule = Callable[[Rewriter, Node], tuple[Node, Any]]

# ------------------------------------------------------------------------------------------ tables


def _ops(*names: str) -> set[Any]:
    """ATen overloads by ``"packet.overload"`` (``"relu"`` alone means ``relu.default``); names this
    torch build lacks are skipped. Only the overloads that capture emits are listed on purpose: every
    op in the rule table has a conformance case (tests/passes/test_tp_conformance.py)."""
    out: set[Any] = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(aten, packet, None)
        if op is not None and hasattr(op, overload or "default"):
            out.add(getattr(op, overload or "default"))
    return out


_UNARY = ("neg", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "silu", "gelu", "relu", "erf", "abs",
          "reciprocal", "square", "softplus", "leaky_relu", "hardtanh", "sin", "cos", "exp2", "log1p", "expm1",
          "sign", "logical_not", "bitwise_not", "hardswish", "mish", "elu", "clone", "contiguous", "alias",
          "detach", "lift_fresh_copy", "zeros_like", "ones_like", "empty_like", "full_like", "_to_copy",
          "to.dtype", "to.dtype_layout", "type_as", "dropout", "floor_divide", "maximum", "minimum")
_BINARY = tuple(f"{op}.{kind}" for op in ("add", "sub", "mul", "div", "rsub", "eq", "ne", "lt", "le", "gt", "ge",
                                          "fill", "masked_fill") for kind in ("Tensor", "Scalar")) + (
    "div.Tensor_mode", "div.Scalar_mode", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar",
    "__and__.Tensor", "__or__.Tensor", "lerp.Scalar", "lerp.Tensor", "where.self", "where.ScalarSelf",
    "where.ScalarOther", "clamp.default", "clamp.Tensor")
_INPLACE = ("add_.Tensor", "add_.Scalar", "sub_.Tensor", "sub_.Scalar", "mul_.Tensor", "mul_.Scalar",
            "div_.Tensor", "div_.Scalar", "relu_", "silu_", "gelu_", "tanh_", "sigmoid_", "hardtanh_",
            "leaky_relu_", "neg_", "exp_", "sqrt_", "clamp_.default", "masked_fill_.Scalar",
            "masked_fill_.Tensor", "fill_.Scalar", "zero_", "detach_")
ELEMENTWISE = _ops(*_UNARY, *_BINARY, *_INPLACE)
"""Elementwise ops (with broadcasting): a shard stays a shard of the broadcast output."""
# ops linear in their single operand: a partial sum stays a partial sum
P_UNARY = _ops("neg", "neg_", "clone", "contiguous", "alias", "detach", "detach_", "lift_fresh_copy", "_to_copy",
               "to.dtype", "to.dtype_layout", "zeros_like", "zero_")
# ops linear in one operand when every other operand is replicated (x * c, x / c; not c / x)
P_SCALE = _ops("mul.Tensor", "mul.Scalar", "div.Tensor", "div.Scalar", "mul_.Tensor", "mul_.Scalar",
               "div_.Tensor", "div_.Scalar")
# sums of partial sums: every tensor operand partial (x + y, x - y, x + x)
P_ADD = _ops("add.Tensor", "sub.Tensor", "add_.Tensor", "sub_.Tensor")
# f(0) == 0: safe on disjoint partial sums (each element lives on one rank, zeros elsewhere)
P_ZERO_PRESERVING = _ops("silu", "gelu", "relu", "tanh", "mul.Tensor", "silu_", "gelu_", "relu_", "tanh_",
                         "mul_.Tensor")
VIEWS = _ops("view", "reshape", "_unsafe_view")
"""Views whose second argument is the output shape (``passes.tp.rules_shape.view``)."""
NOT_OUTPUT = _ops("_assert_tensor_metadata")

# ------------------------------------------------------------------------------------------ helpers


def _nd(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _gather_all(rw: Rewriter, node: Node) -> dict[Node, Placement]:
    for a in rw.tensor_inputs(node):
        if a.op == "get_attr" and not rw.p(a).is_r:
            raise TPShardError(
                f"{fmt(node)} uses the tensor-parallel-sharded parameter {a.target} ({rw.p(a)}), but the pass "
                f"has no sharding rule for {node.target}; mark its module 'replicate' in the plan")
    return {a: R for a in rw.tensor_inputs(node)}


def _resolve_partials(rw: Rewriter, node: Node) -> dict[Node, Placement]:
    return {a: rw.resolve_target(a) for a in rw.tensor_inputs(node) if rw.p(a).is_p}


def _placed(rw: Rewriter, a: Node, want: dict[Node, Placement]) -> Placement:
    return want.get(a, rw.p(a))


def fallback(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """Any op: replicated inputs, replicated output(s)."""
    v = rw.val(node)
    out: Any = [R] * len(v) if isinstance(v, (tuple, list)) else R
    if is_inplace(node.target):
        _check_inplace(rw, node, _gather_all(rw, node))
    new = rw.finish(node, _gather_all(rw, node), out)
    new.meta[META_TP_FALLBACK] = True
    return new, out


def _check_inplace(rw: Rewriter, node: Node, want: dict[Node, Placement]) -> None:
    """An in-place op writes its first argument: it cannot run on a converted copy of it (the
    in-place ops the capture leaves are those ``passes.tp.functionalize`` could not make functional:
    they mutate a graph input, a parameter or a view)."""
    mutated = args_of(node)[0]
    if isinstance(mutated, Node) and mutated in want and want[mutated] != rw.place.get(mutated):
        raise TPShardError(
            f"in-place {fmt(node)} would need its input {mutated.name} converted from {rw.place.get(mutated)} to "
            f"{want[mutated]}, but it mutates a graph input, a parameter or a view, so it cannot run on a copy; "
            "write it out of place or replicate this module")


# ------------------------------------------------------------------------------------------ elementwise


def elementwise(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    """Elementwise ops with broadcasting: a shard of one operand is a shard of the output when the
    others are split alike (replicated operands are split locally, no communication); partial sums
    pass only through ops linear in them (see :func:`_partial_elementwise`), else they are reduced.
    An in-place op's output is its first operand, so its placement cannot change."""
    ops = rw.operands(node)  # one entry per occurrence: mul(x, x) is [x, x]
    ins = list(dict.fromkeys(ops))
    inplace = is_inplace(node.target)
    mutated = args_of(node)[0] if inplace else None
    if any(rw.p(a).is_p for a in ins):
        out_p = _partial_elementwise(rw, node, ops)
        if out_p is not None and (mutated is None or out_p == rw.p(mutated)):
            return rw.finish(node, {}, out_p), out_p
    want = _resolve_partials(rw, node)
    out_nd = rw.ndim(node) if rw.is_tensor(node) else 0
    chosen: Placement | None = None
    if isinstance(mutated, Node) and _placed(rw, mutated, want).is_s:
        chosen = _placed(rw, mutated, want)
    for a in ins if chosen is None else []:
        pl = _placed(rw, a, want)
        if pl.is_s:
            chosen = S(pl.dim + out_nd - rw.ndim(a), pl.parts)
            break
    if chosen is None:
        if inplace:
            _check_inplace(rw, node, want)
        return rw.finish(node, want, R), R
    for a in ins:
        pl = _placed(rw, a, want)
        shift = out_nd - rw.ndim(a)
        local_dim = chosen.dim - shift
        if pl.is_s and S(pl.dim + shift, pl.parts) == chosen:
            continue
        if pl.is_s or (local_dim >= 0 and rw.shape(a)[local_dim] != 1):
            if chosen.parts != 1:
                raise TPShardError(f"{fmt(node)} combines the fused shard {chosen} with {fmt(a)} ({pl}), which is "
                                   "not split into the same blocks")
            want[a] = S(local_dim) if local_dim >= 0 else R
    if inplace:
        _check_inplace(rw, node, want)
    if node.target == aten.dropout.default and args_of(node)[1] > 0 and args_of(node)[2]:
        # each shard needs its own mask (the same mask on every rank would correlate the shards)
        new = rw.finish(node, want, chosen, target=tp_ops.sharded_dropout,
                        args=(args_of(node)[0], args_of(node)[1], args_of(node)[2], rw.index))
        return new, chosen
    return rw.finish(node, want, chosen), chosen


def _partial_elementwise(rw: Rewriter, node: Node, ops: list[Node]) -> Placement | None:
    """The output placement when ``node`` can run on its partial-sum operands as they are (it is
    linear in them, or zero-preserving on disjoint partials of one support), else None.

    ``ops`` lists every operand occurrence: ``mul(x, x)`` on a partial ``x`` has two partial
    occurrences and is not linear (sum_r x_r^2 != (sum_r x_r)^2), so it is resolved first."""
    places = [rw.p(a) for a in ops]
    parts = [i for i, p in enumerate(places) if p.is_p]
    t = node.target
    if t in P_UNARY and len(ops) == 1:
        return places[0]
    out_nd = rw.ndim(node) if rw.is_tensor(node) else 0
    # disjoint partials agree when they name one partition on the same (broadcast-aligned) output dim
    supports = {(places[i].disjoint, places[i].dim + out_nd - rw.ndim(ops[i]) if places[i].disjoint else -1)
                for i in parts}
    support = next(iter(supports)) if len(supports) == 1 else ("", -1)
    same = PD(*support) if support[0] else P
    if len(parts) == 1 and all(places[i].is_r for i in range(len(ops)) if i != parts[0]):
        first = args_of(node)[0] if node.args else None
        if t in P_SCALE and (t not in _DIVS or first is ops[parts[0]]):
            return same
        if support[0] and t in P_ZERO_PRESERVING and len(ops) == 1:
            return same
    if len(parts) == len(ops) >= 2:
        if t in P_ADD:
            return same
        if support[0] and t in P_ZERO_PRESERVING:
            return same
    return None


_DIVS = _ops("div.Tensor", "div.Scalar", "div_.Tensor", "div_.Scalar")


def assert_meta(rw: Rewriter, node: Node) -> tuple[Node, Any]:
    return rw.finish(node, {}, None), None
