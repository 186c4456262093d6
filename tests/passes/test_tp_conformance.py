"""Every tensor-parallel op rule, checked against the single-device op on every input placement.

For each op in the rule table (``passes.tp.model_rules.RULES`` and ``NAMED_RULES``) the cases below
run it on every combination of input placements (replicated, a shard of each dim, a fused 2-block
shard where marked, a partial sum, a disjoint partial sum), including the same value passed twice
and the in-place variants (on graph inputs, and on intermediates made functional by
``passes.tp.functionalize``), for tp=2 (and tp=4 for the shape ops, where uneven head splits
show). ``tests/passes/tp_sim.py`` rewrites the case for every rank with the real rules, runs the
ranks in threads with the collectives done in memory, and compares forward outputs and backward
gradients with the op on the full tensors, in float64. A rule may refuse (``TPShardError`` with a
reason); a wrong number or any other exception fails.

A rule without a case fails ``test_every_rule_has_a_case``: adding an op to the table means adding
its case here.
"""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch

from passes.tp.model_rules import NAMED_RULES, RULES
from passes.tp.placement import P, PD, R, S
from passes.tp.rules import ELEMENTWISE
from tp_sim import I, In, O, Case, Step, all_placements, run_case

aten = torch.ops.aten

X2 = In((4, 8), fused=True)  # [rows, features]; features split in 2 fused blocks too
X3 = In((4, 4, 8))
POS2 = In((4, 8), kind="pos")
MASK = In((4, 8), kind="bool")
BOOL2 = In((4, 8), kind="bool")


def unary(name: str, *extra: Any, spec: In = X2, grad: bool = True, **kwargs: Any) -> Case:
    return Case(name, (spec,), (Step(_op(name), (I(0), *extra), kwargs),), grad=grad)


def binary(name: str, *, spec: In = X2, other: In = X2, grad: bool = True, **kw: Any) -> list[Case]:
    op = _op(name)
    return [Case(name, (spec, other), (Step(op, (I(0), I(1))),), grad=grad, **kw),
            Case(f"{name} broadcast", (spec, In((8,), kind=other.kind)), (Step(op, (I(0), I(1))),), grad=grad, **kw),
            Case(f"{name} same operand twice", (spec,), (Step(op, (I(0), I(0))),), grad=grad, **kw)]


def inplace(name: str, *extra: Any, inputs: tuple[In, ...] = (X2,)) -> list[Case]:
    """The in-place op on a graph input (the rule must run it in place or refuse) and on an
    intermediate (made functional first, as the pass does)."""
    op = _op(name)
    args = (I(0), *extra)
    return [Case(name, inputs, (Step(op, args),)),
            Case(f"{name} on an intermediate", inputs, (Step(aten.clone.default, (I(0),)), Step(op, (O(0), *extra[0:]))),
                 functionalize=True)]


def _op(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(aten, packet), overload or "default")


CASES: list[Case] = []

# ------------------------------------------------------------------------------------------ elementwise
for n in ("neg", "exp", "tanh", "sigmoid", "silu", "gelu", "relu", "erf", "abs", "square", "softplus",
          "leaky_relu", "hardtanh", "sin", "cos", "exp2", "expm1", "hardswish", "mish", "elu", "clone",
          "contiguous", "alias", "lift_fresh_copy", "zeros_like", "ones_like", "full_like", "sign"):
    extra = (2.5,) if n == "full_like" else ()
    CASES.append(unary(n, *extra))
for n in ("rsqrt", "sqrt", "log", "log1p", "reciprocal"):
    CASES.append(unary(n, spec=POS2))
CASES += [unary("detach", grad=False), Case("empty_like", (X2,), (Step(aten.empty_like.default, (I(0),)),),
                                          compare="shape", grad=False), unary("logical_not", spec=BOOL2, grad=False),
          unary("bitwise_not", spec=BOOL2, grad=False),
          Case("_to_copy", (X2,), (Step(aten._to_copy.default, (I(0),), {"dtype": torch.float32}),), tol=1e-6),
          Case("to.dtype", (X2,), (Step(aten.to.dtype, (I(0), torch.float32)),), tol=1e-6),
          Case("to.dtype_layout", (X2,), (Step(aten.to.dtype_layout, (I(0),), {"dtype": torch.float32}),), tol=1e-6),
          Case("type_as", (X2, In((4, 8), kind="f32")), (Step(aten.type_as.default, (I(0), I(1))),), tol=1e-6),
          Case("dropout p=0 train", (X2,), (Step(aten.dropout.default, (I(0), 0.0, True)),)),
          Case("dropout eval", (X2,), (Step(aten.dropout.default, (I(0), 0.5, False)),)),
          Case("floor_divide", (X2, POS2), (Step(aten.floor_divide.default, (I(0), I(1))),), grad=False),
          *binary("maximum"), *binary("minimum")]
CASES[-1:] = CASES[-1:]  # (binary returns lists; kept flat above)
for n in ("add", "sub", "mul", "div", "rsub"):
    CASES += binary(f"{n}.Tensor", other=POS2 if n == "div" else X2)
    CASES.append(unary(f"{n}.Scalar", 1.5))
for n in ("eq", "ne", "lt", "le", "gt", "ge"):
    CASES += binary(f"{n}.Tensor", grad=False)
    CASES.append(unary(f"{n}.Scalar", 0.0, grad=False))
CASES += [
    Case("div.Tensor_mode", (X2, POS2), (Step(aten.div.Tensor_mode, (I(0), I(1)), {"rounding_mode": "floor"}),),
         grad=False),
    Case("div.Scalar_mode", (X2,), (Step(aten.div.Scalar_mode, (I(0), 2.0), {"rounding_mode": "trunc"}),), grad=False),
    unary("pow.Tensor_Scalar", 2), unary("pow.Tensor_Scalar", 3),
    Case("pow.Tensor_Tensor", (POS2, X2), (Step(aten.pow.Tensor_Tensor, (I(0), I(1))),)),
    Case("pow.Scalar", (X2,), (Step(aten.pow.Scalar, (2.0, I(0))),)),
    *binary("__and__.Tensor", spec=BOOL2, other=BOOL2, grad=False),
    *binary("__or__.Tensor", spec=BOOL2, other=BOOL2, grad=False),
    Case("lerp.Scalar", (X2, X2), (Step(aten.lerp.Scalar, (I(0), I(1), 0.3)),)),
    Case("lerp.Tensor", (X2, X2, X2), (Step(aten.lerp.Tensor, (I(0), I(1), I(2))),), limit=60),
    Case("where.self", (MASK, X2, X2), (Step(aten.where.self, (I(0), I(1), I(2))),), limit=60),
    Case("where.ScalarSelf", (MASK, X2), (Step(aten.where.ScalarSelf, (I(0), 1.5, I(1))),)),
    Case("where.ScalarOther", (MASK, X2), (Step(aten.where.ScalarOther, (I(0), I(1), 1.5)),)),
    unary("clamp.default", -0.5, 0.5),
    Case("clamp.Tensor", (X2, X2, X2), (Step(aten.clamp.Tensor, (I(0), I(1), I(2))),), limit=60),
    unary("fill.Scalar", 2.0),
    Case("fill.Tensor", (X2, In(())), (Step(aten.fill.Tensor, (I(0), I(1))),)),
    Case("masked_fill.Scalar", (X2, MASK), (Step(aten.masked_fill.Scalar, (I(0), I(1), 0.0)),)),
    Case("masked_fill.Scalar nonzero", (X2, MASK), (Step(aten.masked_fill.Scalar, (I(0), I(1), -1.0)),)),
    Case("masked_fill.Tensor", (X2, MASK, In(())), (Step(aten.masked_fill.Tensor, (I(0), I(1), I(2))),)),
]
# in-place variants: on a graph input (run in place, or refuse) and on an intermediate (made functional)
for n in ("add_.Tensor", "sub_.Tensor", "mul_.Tensor"):
    CASES += inplace(n, I(1), inputs=(X2, X2))
CASES += inplace("div_.Tensor", I(1), inputs=(X2, POS2))
for n in ("add_.Scalar", "sub_.Scalar", "mul_.Scalar", "div_.Scalar"):
    CASES += inplace(n, 1.5)
for n in ("relu_", "silu_", "gelu_", "tanh_", "sigmoid_", "hardtanh_", "leaky_relu_", "neg_", "exp_", "zero_"):
    CASES += inplace(n)
CASES += inplace("sqrt_", inputs=(POS2,))
CASES += inplace("clamp_.default", -0.5, 0.5)
CASES += inplace("fill_.Scalar", 2.0)
CASES += inplace("masked_fill_.Scalar", I(1), 0.0, inputs=(X2, MASK))
CASES += inplace("masked_fill_.Tensor", I(1), I(2), inputs=(X2, MASK, In(())))
CASES += [Case("detach_", (X2,), (Step(aten.clone.default, (I(0),)), Step(aten.detach_.default, (O(0),))), grad=False)]

# ------------------------------------------------------------------------------------------ shapes
CASES += [
    Case("view split", (X2,), (Step(aten.view.default, (I(0), [4, 2, 4])),)),
    Case("view merge", (X3,), (Step(aten.view.default, (I(0), [16, 8])),)),
    Case("view merge inner", (X3,), (Step(aten.view.default, (I(0), [4, 32])),)),
    Case("view heads", (In((2, 4, 8), fused=True),), (Step(aten.view.default, (I(0), [2, 4, 4, 2])),)),
    Case("reshape", (X3,), (Step(aten.reshape.default, (I(0), [4, -1])),)),
    Case("_unsafe_view", (X2,), (Step(aten._unsafe_view.default, (I(0), [2, 2, 8])),)),
    Case("view.dtype same size", (X2,), (Step(aten.view.dtype, (I(0), torch.int64)),), grad=False),
    Case("view.dtype half size", (X2,), (Step(aten.view.dtype, (I(0), torch.int32)),), grad=False),
    Case("flatten(0, 1)", (X3,), (Step(aten.flatten.using_ints, (I(0), 0, 1)),)),
    Case("flatten(1, 2)", (X3,), (Step(aten.flatten.using_ints, (I(0), 1, 2)),)),
    Case("flatten()", (X3,), (Step(aten.flatten.using_ints, (I(0),)),)),
    Case("flatten(-2, -1)", (X3,), (Step(aten.flatten.using_ints, (I(0), -2, -1)),)),
    Case("unflatten last", (X2,), (Step(aten.unflatten.int, (I(0), 1, [2, 4])),)),
    Case("unflatten first", (X2,), (Step(aten.unflatten.int, (I(0), 0, [2, -1])),)),
    Case("expand", (In((4, 1, 8)),), (Step(aten.expand.default, (I(0), [4, 4, 8])),)),
    Case("expand new dim", (In((8,)),), (Step(aten.expand.default, (I(0), [4, 8])),)),
    Case("transpose", (X3,), (Step(aten.transpose.int, (I(0), 1, 2)),)),
    Case("permute", (X3,), (Step(aten.permute.default, (I(0), [2, 0, 1])),)),
    Case("t", (X2,), (Step(aten.t.default, (I(0),)),)),
    Case("unsqueeze", (X2,), (Step(aten.unsqueeze.default, (I(0), 1)),)),
    Case("squeeze.dim", (In((4, 1, 8)),), (Step(aten.squeeze.dim, (I(0), 1)),)),
    Case("squeeze.dims", (In((4, 1, 8)),), (Step(aten.squeeze.dims, (I(0), [1])),)),
    Case("squeeze", (In((4, 1, 8)),), (Step(aten.squeeze.default, (I(0),)),)),
    Case("slice other dim", (X2,), (Step(aten.slice.Tensor, (I(0), 0, 1, 3)),)),
    Case("slice features", (X2,), (Step(aten.slice.Tensor, (I(0), 1, 0, 4)),)),
    Case("slice whole", (X2,), (Step(aten.slice.Tensor, (I(0), 1, 0, 9223372036854775807)),)),
    Case("select", (X3,), (Step(aten.select.int, (I(0), 1, 2)),)),
    Case("select last", (X2,), (Step(aten.select.int, (I(0), 1, 5)),)),
    Case("split features", (X2,), (Step(aten.split.Tensor, (I(0), 4, 1)),)),
    Case("split rows", (X2,), (Step(aten.split.Tensor, (I(0), 2)),)),
    Case("split uneven", (X2,), (Step(aten.split.Tensor, (I(0), 3, 1)),)),
    Case("split_with_sizes", (X2,), (Step(aten.split_with_sizes.default, (I(0), [4, 4], 1)),)),
    Case("split_with_sizes uneven", (X2,), (Step(aten.split_with_sizes.default, (I(0), [2, 6], 1)),)),
    Case("chunk", (X2,), (Step(aten.chunk.default, (I(0), 2, 1)),)),
    Case("chunk rows", (X2,), (Step(aten.chunk.default, (I(0), 2)),)),
    Case("getitem of split", (X2,), (Step(aten.split.Tensor, (I(0), 4, 1)), Step(operator.getitem, (O(0), 1)))),
    Case("cat features", (X2, X2), (Step(aten.cat.default, ([I(0), I(1)], 1)),)),
    Case("cat rows", (X2, X2), (Step(aten.cat.default, ([I(0), I(1)],)),)),
    Case("cat same operand twice", (X2,), (Step(aten.cat.default, ([I(0), I(0)], 1)),)),
    Case("cat with an empty cache", (In((0,)), X3), (Step(aten.cat.default, ([I(0), I(1)], -2)),)),
]

# ------------------------------------------------------------------------------------------ reductions, norms
CASES += [
    Case("sum.dim_IntList", (X2,), (Step(aten.sum.dim_IntList, (I(0), [1])),)),
    Case("sum.dim_IntList keepdim", (X3,), (Step(aten.sum.dim_IntList, (I(0), [0], True)),)),
    Case("sum.default", (X2,), (Step(aten.sum.default, (I(0),)),)),
    Case("mean.dim", (X3,), (Step(aten.mean.dim, (I(0), [-1], True)),)),
    Case("mean.default", (X2,), (Step(aten.mean.default, (I(0),)),)),
    Case("amax", (X2,), (Step(aten.amax.default, (I(0), [1])),)),
    Case("amin", (X3,), (Step(aten.amin.default, (I(0), [0], True)),)),
    Case("softmax.int", (X2,), (Step(aten.softmax.int, (I(0), 1)),)),
    Case("softmax.int rows", (X2,), (Step(aten.softmax.int, (I(0), 0)),)),
    Case("_softmax", (X3,), (Step(aten._softmax.default, (I(0), -1, False)),)),
    Case("log_softmax.int", (X2,), (Step(aten.log_softmax.int, (I(0), 1)),)),
    Case("_log_softmax", (X3,), (Step(aten._log_softmax.default, (I(0), 0, False)),)),
    Case("layer_norm", (X3, In((8,), kind="param"), In((8,), kind="param")),
         (Step(aten.layer_norm.default, (I(0), [8], I(1), I(2), 1e-5)),)),
    Case("rms_norm", (X3, In((8,), kind="param")), (Step(aten.rms_norm.default, (I(0), [8], I(1), 1e-6)),)),
    Case("rms_norm written out (x * x)", (X3,), (Step(aten.mul.Tensor, (I(0), I(0))),
                                                 Step(aten.mean.dim, (O(0), [-1], True)),
                                                 Step(aten.add.Tensor, (O(1), 1e-6)), Step(aten.rsqrt.default, (O(2),)),
                                                 Step(aten.mul.Tensor, (I(0), O(3))))),
]

# ------------------------------------------------------------------------------------------ matmuls
W = In((8, 8), kind="param", fused=True)
CASES += [
    Case("linear", (X3, W, In((8,), kind="param", fused=True)), (Step(aten.linear.default, (I(0), I(1), I(2))),)),
    Case("linear no bias", (X3, W), (Step(aten.linear.default, (I(0), I(1))),)),
    Case("linear activation weight", (X2, In((8, 8))), (Step(aten.linear.default, (I(0), I(1))),)),
    Case("addmm (Conv1D)", (In((8,), kind="param", fused=True), X2, W), (Step(aten.addmm.default, (I(0), I(1), I(2))),)),
    Case("mm param", (X2, W), (Step(aten.mm.default, (I(0), I(1))),)),
    Case("mm activations", (X2, In((8, 4))), (Step(aten.mm.default, (I(0), I(1))),)),
    Case("matmul param", (X3, W), (Step(aten.matmul.default, (I(0), I(1))),)),
    Case("matmul activations", (In((2, 4, 4, 8)), In((2, 4, 8, 4))), (Step(aten.matmul.default, (I(0), I(1))),),
         limit=60),
    Case("bmm", (In((4, 4, 8)), In((4, 8, 4))), (Step(aten.bmm.default, (I(0), I(1))),)),
    Case("bmm same operand", (In((4, 8, 8)),), (Step(aten.bmm.default, (I(0), I(0))),)),
]

# ------------------------------------------------------------------------------------------ model ops
IDS = In((4, 4), kind="int", high=8)
TARGET = In((8,), kind="int", high=8)
CASES += [
    Case("embedding", (In((8, 4), kind="param"), IDS), (Step(aten.embedding.default, (I(0), I(1))),)),
    Case("embedding padding", (In((8, 4), kind="param"), IDS), (Step(aten.embedding.default, (I(0), I(1), 2)),)),
    Case("cross_entropy", (In((8, 8)), TARGET), (Step(aten.cross_entropy_loss.default, (I(0), I(1))),)),
    Case("cross_entropy sum, ignore_index", (In((8, 8)), In((8,), kind="int", high=8, ignore=True)),
         (Step(aten.cross_entropy_loss.default, (I(0), I(1), None, 2, -100)),)),
    Case("cross_entropy none", (In((8, 8)), TARGET), (Step(aten.cross_entropy_loss.default, (I(0), I(1), None, 0)),)),
    Case("cross_entropy label smoothing", (In((8, 8)), In((8,), kind="int", high=8, ignore=True)),
         (Step(aten.cross_entropy_loss.default, (I(0), I(1), None, 1, -100, 0.1)),)),
    Case("cross_entropy class weights", (In((8, 8)), TARGET, In((8,), kind="const", value=torch.rand(8, dtype=torch.float64) + 0.5)),
         (Step(aten.cross_entropy_loss.default, (I(0), I(1), I(2))),)),
    Case("nll_loss", (In((8, 8)), TARGET), (Step(aten.nll_loss.default, (I(0), I(1))),)),
    Case("nll_loss_nd", (In((8, 8)), TARGET), (Step(aten.nll_loss_nd.default, (I(0), I(1), None, 2, -100)),)),
    Case("log_softmax -> nll_loss", (In((8, 8)), In((8,), kind="int", high=8, ignore=True)),
         (Step(aten.log_softmax.int, (I(0), 1)), Step(aten.nll_loss.default, (O(0), I(1))))),
    Case("log_softmax -> nll_loss_nd", (In((8, 8)), TARGET),
         (Step(aten._log_softmax.default, (I(0), 1, False)), Step(aten.nll_loss_nd.default, (O(0), I(1), None, 2)))),
    Case("sdpa", (In((2, 4, 4, 8)),) * 3, (Step(aten.scaled_dot_product_attention.default, (I(0), I(1), I(2))),),
         limit=40),
    Case("sdpa causal", (In((2, 4, 4, 8)),) * 3,
         (Step(aten.scaled_dot_product_attention.default, (I(0), I(1), I(2)), {"is_causal": True}),), limit=20),
    Case("sdpa mask", (In((2, 4, 4, 8)), In((2, 4, 4, 8)), In((2, 4, 4, 8)), In((2, 1, 4, 4))),
         (Step(aten.scaled_dot_product_attention.default, (I(0), I(1), I(2), I(3))),), limit=30),
    Case("sdpa same q, k, v", (In((2, 4, 4, 8)),),
         (Step(aten.scaled_dot_product_attention.default, (I(0), I(0), I(0))),)),
    Case("index rows", (X2, In((3,), kind="int", high=4)), (Step(aten.index.Tensor, (I(0), [I(1)])),)),
    Case("index 3-D", (X3, In((2, 3), kind="int", high=4)), (Step(aten.index.Tensor, (I(0), [I(1)])),)),
    Case("_assert_tensor_metadata", (X2,), (Step(aten._assert_tensor_metadata.default, (I(0),),
                                                 {"dtype": torch.float64}),), compare="none", grad=False),
]


def _grouped_cases() -> list[Case]:
    if "transformers.grouped_mm_fallback.default" not in NAMED_RULES:
        return []
    import transformers.integrations.moe  # noqa: F401 - registers transformers::grouped_mm_fallback

    op = torch.ops.transformers.grouped_mm_fallback.default
    offs = In((4,), kind="const", value=torch.tensor([2, 4, 5, 8], dtype=torch.int32))
    experts = In((4, 8, 4), kind="param")
    rows = In((8, 8))  # 8 token rows sorted by expert: experts own rows [0, 2), [2, 4), [4, 5), [5, 8)
    return [Case("grouped_mm", (rows, experts, offs), (Step(op, (I(0), I(1), I(2))),)),
            Case("grouped_mm -> silu * up -> grouped_mm",
                 (rows, In((4, 8, 8), kind="param"), In((4, 4, 8), kind="param"), offs),
                 (Step(op, (I(0), I(1), I(3))), Step(aten.chunk.default, (O(0), 2, -1)),
                  Step(operator.getitem, (O(1), 0)), Step(operator.getitem, (O(1), 1)),
                  Step(aten.silu.default, (O(2),)), Step(aten.mul.Tensor, (O(4), O(3))),
                  Step(op, (O(5), I(2), I(3)))), limit=40),
            Case("grouped_mm disjoint rows gathered", (rows, experts, offs, In((3,), kind="int", high=8)),
                 (Step(op, (I(0), I(1), I(2))), Step(aten.index.Tensor, (O(0), [I(3)])),
                  Step(aten.mul.Tensor, (O(1), O(1))))),
            ]


CASES += _grouped_cases()
SHAPE_OPS = {aten.view.default, aten.reshape.default, aten.flatten.using_ints, aten.unflatten.int, aten.split.Tensor,
             aten.chunk.default, aten.split_with_sizes.default, aten.cat.default, aten.linear.default}


def _ids(case: Case) -> str:
    return case.name


def test_every_rule_has_a_case() -> None:
    covered = {t for c in CASES for t in c.targets}
    missing = [str(op) for op in list(RULES) + list(NAMED_RULES) if op not in covered and str(op) not in
               {str(t) for t in covered}]
    assert not missing, f"rules without a conformance case: {sorted(missing)}; add cases to {__file__}"
    assert ELEMENTWISE <= covered


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_rule_matches_the_single_device_op(case: Case) -> None:
    tried = refused = 0
    for tp in (2, 4) if any(t in SHAPE_OPS for t in case.targets) else (2,):
        for places in all_placements(case, tp):
            # sequence parallelism changes only where a partial sum of 3+ dims is reduced to
            for sp in (False, True) if any(p.is_p and len(s.shape) >= 3 for p, s in zip(places, case.inputs)) \
                    else (False,):
                outcome = run_case(case, places, tp, sp=sp)
                tried += 1
                refused += bool(outcome.refused)
    assert tried and refused < tried, f"{case.name}: every placement was refused"


# ------------------------------------------------------------------------------------------ what the rules must do
# (beyond being exact: where they must not fall back to moving data)


def _out(case: Case, places: tuple[Any, ...], tp: int = 2) -> Any:
    outcome = run_case(case, places, tp)
    assert not outcome.refused, outcome.refused
    return outcome.out_places[0]


def test_partial_sums_stay_partial_only_where_linear() -> None:
    find = {c.name: c for c in CASES}
    assert _out(find["mul.Tensor"], (P, R)) == P                      # x * c
    assert _out(find["mul.Tensor same operand twice"], (P,)) == R     # x * x: resolved first (was P: wrong)
    assert _out(find["mul.Tensor same operand twice"], (PD("rows", 0),)) == PD("rows", 0)  # disjoint: exact
    assert _out(find["add.Tensor"], (P, P)) == P                      # sum of partial sums
    assert _out(find["add.Tensor"], (P, R)) == R
    assert _out(find["div.Tensor"], (P, R)) == P
    assert _out(find["div.Tensor"], (R, P)) == R                      # c / x is not linear
    assert _out(find["pow.Tensor_Scalar"], (P,)) == R
    assert _out(find["sum.dim_IntList"], (P,)) == P
    assert _out(find["mean.dim"], (P,)) == P
    assert _out(find["flatten(0, 1)"], (S(2),)) == S(1)
    assert _out(find["flatten(0, 1)"], (S(0),)) == S(0)
    assert _out(find["unflatten last"], (S(1),)) == S(1)
    assert _out(find["cat with an empty cache"], (R, S(2))) == S(2)   # HF's empty KV cache (was IndexError)


def test_inplace_on_a_partial_sum() -> None:
    find = {c.name: c for c in CASES}
    # on a graph input the mutation cannot move to a converted copy: refused with the reason
    refusal = run_case(find["add_.Tensor"], (P, R), 2).refused
    assert "in-place" in refusal and "cannot run on a copy" in refusal
    # on an intermediate (a residual `out += x` inside a block) it runs out of place: exact
    assert _out(find["add_.Tensor on an intermediate"], (P, R)) == R
    assert _out(find["mul_.Tensor"], (P, R)) == P  # linear in place: no conversion needed
