"""passes.eval_mode: every rule of EVAL_RULES against the op's own eval-mode result, and the check
that finds a model's Python branch on ``self.training``."""

from __future__ import annotations

import operator
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from passes.eval_mode import EVAL_RULES, eval_difference, eval_graph
from passes.ops import bn_ops, tp_ops
from planner.capture import capture

aten = torch.ops.aten
C, H = 3, 5


class Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("w", torch.rand(C, generator=g) + 0.5)
        self.register_buffer("b", torch.randn(C, generator=g))
        self.register_buffer("rm", torch.randn(C, generator=g))
        self.register_buffer("rv", torch.rand(C, generator=g) + 0.5)
        self.register_buffer("bn_num_batches_tracked", torch.tensor(7))
        self.register_buffer("other", torch.zeros(()))
        self.register_buffer("noise", torch.zeros(2, C, 4))
        for gates in (1, 3, 4):  # two recurrent layers of width H on features of 4: rnn, gru, lstm
            for layer in range(2):
                for name, shape in (("w_ih", (gates * H, 4 if layer == 0 else H)), ("w_hh", (gates * H, H)),
                                    ("b_ih", (gates * H,)), ("b_hh", (gates * H,))):
                    self.register_buffer(f"rnn{gates}_{name}_{layer}", torch.randn(shape, generator=g) * 0.5)
        self.register_buffer("h0", torch.zeros(2, 2, H))
        self.register_buffer("batch_sizes", torch.tensor([2, 2, 2]))


X = torch.randn(2, C, 4, generator=torch.Generator().manual_seed(1))
Q = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(2))


def _norm(op: Any, training: bool, *, nbt: bool = False, axis: bool = False, running: bool = True,
          first: bool = False) -> Callable[[torch.fx.Graph], torch.fx.Node]:
    def build(g: torch.fx.Graph) -> torch.fx.Node:
        x = g.placeholder("x")
        w, b = g.get_attr("w"), g.get_attr("b")
        rm, rv = (g.get_attr("rm"), g.get_attr("rv")) if running else (None, None)
        if op in (bn_ops.batch_norm_sync, bn_ops.batch_norm_local):
            args: tuple[Any, ...] = (x, w, b, rm, rv, g.get_attr("bn_num_batches_tracked"), 0.1, 1e-5)
        elif op in (bn_ops.instance_norm_sync, bn_ops.instance_norm_local):
            args = (x, w, b, rm, rv, 0.1, 1e-5)
        elif op in (aten.native_batch_norm.default, aten._native_batch_norm_legit_functional.default):
            args = (x, w, b, rm, rv, training, 0.1, 1e-5)
        else:
            args = (x, w, b, rm, rv, training, 0.1, 1e-5, False)
        out = g.call_function(op, args + (("dp",) if axis else ()))
        return g.call_function(operator.getitem, (out, 0)) if first else out
    return build


def _call(op: Any, *rest: Any, inputs: int = 1, first: bool = False) -> Callable[[torch.fx.Graph], torch.fx.Node]:
    def build(g: torch.fx.Graph) -> torch.fx.Node:
        xs = [g.placeholder(f"x{i}") for i in range(inputs)]
        args = [g.get_attr(a[1:]) if isinstance(a, str) and a.startswith("@") else a for a in rest]
        out = g.call_function(op, (*xs, *args))
        return g.call_function(operator.getitem, (out, 0)) if first else out
    return build


RNNS = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


def _rnn_args(kind: str, x: Any, get: Callable[[str], Any], train: bool, packed: bool) -> tuple[Any, ...]:
    """``aten.<kind>.input`` (batch first) or ``.data`` (packed: ``x`` is the data) arguments: two
    layers, dropout 0.5 between them."""
    gates = RNNS[kind]
    params = [get(f"rnn{gates}_{n}_{layer}") for layer in range(2) for n in ("w_ih", "w_hh", "b_ih", "b_hh")]
    hx = [get("h0"), get("h0")] if kind == "lstm" else get("h0")
    if packed:
        return (x, get("batch_sizes"), hx, params, True, 2, 0.5, train, False)
    return (x, hx, params, True, 2, 0.5, train, False, True)


def _rnn(kind: str, packed: bool) -> tuple[Callable[[torch.fx.Graph], torch.fx.Node], tuple[torch.Tensor, ...],
                                          Callable[..., torch.Tensor]]:
    op = getattr(getattr(aten, kind), "data" if packed else "input")

    def build(g: torch.fx.Graph) -> torch.fx.Node:
        out = g.call_function(op, _rnn_args(kind, g.placeholder("x0"), g.get_attr, True, packed))
        return g.call_function(operator.getitem, (out, 0))

    x = X.transpose(0, 1).reshape(-1, 4) if packed else X  # (batch 2, seq 3, 4), packed: 3 steps of 2
    return build, (x,), lambda r, x: op(*_rnn_args(kind, x, lambda n: getattr(r, n), False, packed))[0]


def _bn_eval(r: Root, x: torch.Tensor) -> torch.Tensor:
    return F.batch_norm(x, r.rm, r.rv, r.w, r.b, training=False, eps=1e-5)


def _in_eval(r: Root, x: torch.Tensor) -> torch.Tensor:
    return F.instance_norm(x, r.rm, r.rv, r.w, r.b, use_input_stats=False, eps=1e-5)


def _sdpa(r: Root, q: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, q, q)


# op -> (graph in training mode, inputs, the op's eval-mode result)
CASES: dict[Any, tuple[Callable[[torch.fx.Graph], torch.fx.Node], tuple[torch.Tensor, ...], Callable[..., torch.Tensor]]] = {
    aten.dropout.default: (_call(aten.dropout.default, 0.5, True), (X,), lambda r, x: x),
    aten.native_dropout.default: (_call(aten.native_dropout.default, 0.5, True, first=True), (X,), lambda r, x: x),
    aten.feature_dropout.default: (_call(aten.feature_dropout.default, 0.5, True), (X,), lambda r, x: x),
    aten.alpha_dropout.default: (_call(aten.alpha_dropout.default, 0.5, True), (X,), lambda r, x: x),
    aten.feature_alpha_dropout.default: (_call(aten.feature_alpha_dropout.default, 0.5, True), (X,), lambda r, x: x),
    tp_ops.sharded_dropout: (_call(tp_ops.sharded_dropout, 0.5, True, 1), (X,), lambda r, x: x),
    aten.rrelu_with_noise.default: (_call(aten.rrelu_with_noise.default, "@noise", 0.1, 0.3, True), (X,),
                                    lambda r, x: F.leaky_relu(x, 0.2)),
    aten.scaled_dot_product_attention.default: (
        _call(aten.scaled_dot_product_attention.default, None, 0.5, inputs=3), (Q, Q, Q), lambda r, *q: _sdpa(r, Q)),
    aten._scaled_dot_product_flash_attention_for_cpu.default: (
        _call(aten._scaled_dot_product_flash_attention_for_cpu.default, 0.5, inputs=3, first=True), (Q, Q, Q),
        lambda r, *q: _sdpa(r, Q)),
    aten.batch_norm.default: (_norm(aten.batch_norm.default, True), (X,), _bn_eval),
    aten.native_batch_norm.default: (_norm(aten.native_batch_norm.default, True, first=True), (X,), _bn_eval),
    aten._native_batch_norm_legit_functional.default: (
        _norm(aten._native_batch_norm_legit_functional.default, True, first=True), (X,), _bn_eval),
    aten.instance_norm.default: (_norm(aten.instance_norm.default, True), (X,), _in_eval),
    bn_ops.batch_norm_sync: (_norm(bn_ops.batch_norm_sync, True, axis=True), (X,), _bn_eval),
    bn_ops.batch_norm_local: (_norm(bn_ops.batch_norm_local, True), (X,), _bn_eval),
    bn_ops.instance_norm_sync: (_norm(bn_ops.instance_norm_sync, True, axis=True), (X,), _in_eval),
    bn_ops.instance_norm_local: (_norm(bn_ops.instance_norm_local, True), (X,), _in_eval),
    aten.add_.Tensor: (_call(aten.add_.Tensor, 1, inputs=0), (), None),  # on num_batches_tracked: below
    **{getattr(aten, kind).input: _rnn(kind, False) for kind in RNNS},
    **{getattr(aten, kind).data: _rnn(kind, True) for kind in RNNS},
}
# CUDA-only kernels: the rewrite is checked on the graph (they cannot run here)
STRUCTURAL = {
    aten._scaled_dot_product_flash_attention.default: (3, (0.5, False)),
    aten._scaled_dot_product_efficient_attention.default: (5, (None, False, 0.5)),
}


def test_every_rule_has_a_case() -> None:
    assert set(EVAL_RULES) == set(CASES) | set(STRUCTURAL)


def _op_id(op: object) -> str:
    """An op's name in a test id: an aten overload's (``aten.dropout.default``), a runtime function's
    qualified name (never its address, which differs between processes)."""
    return str(op) if isinstance(op, torch._ops.OpOverload) else f"{op.__module__}.{op.__qualname__}"  # type: ignore[attr-defined]


@pytest.mark.parametrize("op", [op for op in CASES if op is not aten.add_.Tensor], ids=_op_id)
def test_the_rewrite_computes_the_ops_eval_mode_and_changes_no_state(op: Any) -> None:
    build, inputs, want = CASES[op]
    root, g = Root(), torch.fx.Graph()
    g.output(build(g))
    gm = torch.fx.GraphModule(root, g)
    before = {k: v.clone() for k, v in root.state_dict().items()}
    ev = eval_graph(gm)
    assert ev is not gm and gm.graph is not ev.graph
    got = ev(*inputs)
    torch.testing.assert_close(got, want(root, *inputs), rtol=1e-6, atol=1e-6)
    assert all(torch.equal(before[k], v) for k, v in root.state_dict().items())  # running stats unchanged
    for n in ev.graph.nodes:  # shares the tensors: no copy of the weights
        if n.op == "get_attr":
            assert getattr(ev, str(n.target)) is getattr(root, str(n.target))


@pytest.mark.parametrize("op", list(STRUCTURAL), ids=_op_id)
def test_fused_attention_kernels_lose_their_dropout(op: Any) -> None:
    index, args = STRUCTURAL[op]
    g = torch.fx.Graph()
    q = [g.placeholder(f"q{i}") for i in range(3)]
    g.output(g.call_function(op, (*q, *args)))
    ev = eval_graph(torch.fx.GraphModule(Root(), g))
    (node,) = [n for n in ev.graph.nodes if n.op == "call_function"]
    assert node.args[index] == 0.0


@pytest.mark.parametrize("build", [
    _call(aten.dropout.default, 0.5, False), _norm(aten.batch_norm.default, False),
    _norm(aten.batch_norm.default, True, running=False), _norm(bn_ops.batch_norm_sync, True, axis=True, running=False),
    _call(aten.scaled_dot_product_attention.default, None, 0.0, inputs=3),
    _call(aten.add_.Tensor, "@other", inputs=0),
], ids=["dropout-eval", "bn-eval", "bn-no-running-stats", "bn-sync-no-running-stats", "sdpa-p0", "add_-other"])
def test_ops_already_as_in_eval_mode_are_left_alone(build: Callable[[torch.fx.Graph], torch.fx.Node]) -> None:
    g = torch.fx.Graph()
    g.output(build(g))
    gm = torch.fx.GraphModule(Root(), g)
    assert eval_graph(gm) is gm


def test_the_batch_count_is_not_incremented() -> None:
    root, g = Root(), torch.fx.Graph()
    x = g.placeholder("x")
    g.call_function(aten.add_.Tensor, (g.get_attr("bn_num_batches_tracked"), 1))
    g.output(g.call_function(aten.mul.Tensor, (x, 2.0)))
    ev = eval_graph(torch.fx.GraphModule(root, g))
    torch.testing.assert_close(ev(X), X * 2)
    assert int(root.bn_num_batches_tracked) == 7


class Noisy(nn.Module):
    def __init__(self, branch: bool) -> None:
        super().__init__()
        self.a, self.drop, self.bn, self.b = nn.Linear(4, 4), nn.Dropout(0.3), nn.BatchNorm1d(4), nn.Linear(4, 1)
        self.branch = branch

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.drop(self.a(x)))
        if self.branch and self.training:
            h = h + 0.01 * torch.randn_like(h)
        h = F.scaled_dot_product_attention(h[None], h[None], h[None], dropout_p=0.2 if self.training else 0)[0]
        return ((self.b(h) - y) ** 2).mean()


@pytest.mark.parametrize("branch", [False, True], ids=["mode-ops-only", "python-branch"])
def test_a_python_branch_on_self_training_is_found_with_its_line(branch: bool) -> None:
    torch.manual_seed(0)
    model = Noisy(branch)
    batch = (torch.randn(8, 4), torch.randn(8, 1))
    train = capture(model, batch, annotate=False).gm
    model.eval()
    evaluated = capture(model, batch, annotate=False).gm
    reason = eval_difference(train, evaluated)
    if not branch:
        assert reason is None
        with torch.no_grad():
            torch.testing.assert_close(eval_graph(train)(*batch), model(*batch))
    else:
        assert reason is not None and "in training mode it runs" in reason and "test_eval_mode.py" in reason, reason


class RandomBlocks(nn.Module):
    """HF BigBird's block-sparse attention: in training it picks random blocks with numpy after
    seeding it (the same every call, so the trace's constant is right); in eval it picks none."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            np.random.seed(0)
            picked = np.random.permutation(4) < 2
        else:
            picked = np.zeros(4, dtype=bool)
        return (self.a(x) * torch.from_numpy(picked).to(x.dtype)).sum()


def test_a_constant_the_trace_baked_in_with_other_values_in_eval_mode_is_a_difference() -> None:
    """pm.evaluate of HF BigBirdForMaskedLM (dp2) returned 4.729641, the training mode's loss
    with its random blocks, where one process in eval mode gives 4.729603, silently: both captures
    run the same ops, and the comparison did not look at the values of the tensors baked into them."""
    model = RandomBlocks()
    x = torch.randn(3, 4)
    train = capture(model, (x,), annotate=False).gm
    assert eval_difference(train, capture(model, (x,), annotate=False).gm) is None
    model.eval()
    reason = eval_difference(train, capture(model, (x,), annotate=False).gm)
    assert reason is not None and "that the trace baked into the graph" in reason and "other values in eval mode" \
        in reason, reason


class _CacheAndDropout(nn.Module):
    """HF GPT-2 with its default use_cache: each layer's empty KV cache (``torch.tensor([])``) is a
    constant of the trace, beside a dropout (so the training graph is rewritten, on a copy)."""

    def __init__(self, blocks: bool = False) -> None:
        super().__init__()
        self.a, self.drop, self.blocks = nn.Linear(4, 4), nn.Dropout(0.1), blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = torch.cat([torch.tensor([]), x[0]])
        picked = np.random.RandomState(0).permutation(4) < 2 if self.training and self.blocks else np.ones(4, bool)
        return (self.drop(self.a(x)) * torch.from_numpy(picked).to(x.dtype)).sum() + cache.sum()


@pytest.mark.parametrize("blocks", [False, True])
def test_constants_are_compared_though_the_training_graph_is_rewritten_on_a_copy(blocks: bool) -> None:
    """The copy eval_graph makes of a training graph with a dropout registers every tensor it reads
    as a buffer, the trace's constants too: their values went unchecked there and were compared with
    a digest in the eval capture, so pm.evaluate of HF GPT-2 (default config) was refused for its
    empty KV cache, and a constant that does differ (BigBird's random blocks) was caught only by that
    accident."""
    model = _CacheAndDropout(blocks)
    x = torch.randn(3, 4)
    train = capture(model, (x,), annotate=False).gm
    assert eval_graph(train) is not train
    model.eval()
    reason = eval_difference(train, capture(model, (x,), annotate=False).gm)
    if blocks:
        assert reason is not None and "other values in eval mode" in reason, reason
    else:
        assert reason is None, reason
