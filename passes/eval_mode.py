"""Eval mode as a graph rewrite: the forward a model runs after ``model.eval()``.

Rank graphs are compiled from a capture in training mode, so their dropouts drop and their batch
norms normalize with batch statistics and update running ones. :func:`eval_graph` rewrites a graph
(a capture or a compiled rank graph) to what the same ops do in eval mode, sharing the original's
parameters, buffers and submodules (data-parallel buckets and FSDP units included), so evaluating
reads the weights training is updating, without a copy. One table, :data:`EVAL_RULES`, says what
each training-dependent op becomes:

* the dropout family (``aten.dropout``, ``native_dropout``, ``feature_dropout``, ``alpha_dropout``,
  ``feature_alpha_dropout``, the tensor-parallel ``tp_ops.sharded_dropout``), ``rrelu_with_noise``
  and the recurrent layers (``lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``: dropout between layers):
  their ``train`` argument becomes ``False``; scaled dot-product attention (and its flash / efficient
  kernels): ``dropout_p`` becomes 0;
* batch norm with running statistics (``aten.batch_norm``, ``native_batch_norm``,
  ``_native_batch_norm_legit_functional``; the data-parallel pass's ``bn_ops.batch_norm_sync`` and
  ``batch_norm_local``): normalize with the running statistics and leave them unchanged; without
  running statistics ``nn.BatchNorm*d`` uses batch statistics in eval too, so the op stays;
* instance norm with running statistics (``aten.instance_norm``, ``bn_ops.instance_norm_sync`` /
  ``instance_norm_local``): likewise;
* ``num_batches_tracked.add_(1)``: dropped (eval does not count batches).

A model can also branch on ``self.training`` in Python (noise added only in training, a router's
jitter); a rewrite of the ops cannot see that. :func:`eval_difference` compares the rewritten
training capture with a capture taken in eval mode and names the first op where they differ, so
such a model is refused instead of evaluated with the training branch. The comparison includes the
values of the tensors a trace bakes into the graph (numbers the forward computed in Python, as HF
BigBird's random blocks drawn with numpy in training only).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch
import torch.fx

from passes.graph_utils import clone_graph_module
from passes.ops import bn_ops, tp_ops
from passes.tp.rewrite import source_of

__all__ = ["EVAL_RULES", "eval_graph", "eval_difference"]

aten = torch.ops.aten

Rule = Callable[[torch.fx.Node], bool]
"""Rewrites ``node`` in place for eval mode; returns whether it changed anything."""


def _set_arg(index: int, name: str) -> Rule:
    """Set the boolean argument at ``index`` (or keyword ``name``) to False."""
    def rule(node: torch.fx.Node) -> bool:
        if index < len(node.args):
            if node.args[index] is False:
                return False
            node.args = (*node.args[:index], False, *node.args[index + 1:])
            return True
        if node.kwargs.get(name, True) is False:
            return False
        node.kwargs = {**node.kwargs, name: False}
        return True
    return rule


def _no_attention_dropout(index: int) -> Rule:
    """Attention's own dropout probability (argument ``index``, keyword ``dropout_p``) becomes 0:
    nanoGPT and Hugging Face pass ``dropout_p=self.dropout if self.training else 0``."""
    def rule(node: torch.fx.Node) -> bool:
        if index < len(node.args):
            if not node.args[index]:
                return False
            node.args = (*node.args[:index], 0.0, *node.args[index + 1:])
            return True
        if not node.kwargs.get("dropout_p"):
            return False
        node.kwargs = {**node.kwargs, "dropout_p": 0.0}
        return True
    return rule


def _with_running_stats(index: int, name: str, running_mean: int = 3) -> Rule:
    """Like :func:`_set_arg`, only when the op has running statistics (else eval mode uses the
    batch's statistics too, as ``nn.BatchNorm*d`` / ``nn.InstanceNorm*d`` do)."""
    flip = _set_arg(index, name)

    def rule(node: torch.fx.Node) -> bool:
        if len(node.args) <= running_mean or node.args[running_mean] is None:
            return False
        return flip(node)
    return rule


def _to_aten_norm(target: Any, flag: bool) -> Rule:
    """``bn_ops.*_norm_sync/local(x, w, b, rm, rv, [nbt,] momentum, eps[, axis])`` with running
    statistics becomes ``target(x, w, b, rm, rv, <flag>, 0.0, eps, False)``: the eval-mode aten
    op (no update, no communication: the running statistics are the same on every rank)."""
    def rule(node: torch.fx.Node) -> bool:
        x, w, b, rm, rv = node.args[:5]
        if rm is None:
            return False
        eps = node.args[7] if target is aten.batch_norm.default else node.args[6]
        node.target = target
        node.args = (x, w, b, rm, rv, flag, 0.0, eps, False)
        node.kwargs = {}
        return True
    return rule


def _drop_batch_count(node: torch.fx.Node) -> bool:
    """``num_batches_tracked.add_(1)``: eval mode does not count batches."""
    counted = node.args[0]
    if not (isinstance(counted, torch.fx.Node) and counted.op == "get_attr"
            and str(counted.target).endswith("num_batches_tracked")):
        return False
    node.replace_all_uses_with(counted)
    node.graph.erase_node(node)
    return True


EVAL_RULES: dict[Any, Rule] = {
    aten.dropout.default: _set_arg(2, "train"),
    aten.native_dropout.default: _set_arg(2, "train"),
    aten.feature_dropout.default: _set_arg(2, "train"),
    aten.alpha_dropout.default: _set_arg(2, "train"),
    aten.feature_alpha_dropout.default: _set_arg(2, "train"),
    tp_ops.sharded_dropout: _set_arg(2, "train"),
    aten.rrelu_with_noise.default: _set_arg(4, "training"),
    aten.scaled_dot_product_attention.default: _no_attention_dropout(4),
    aten._scaled_dot_product_flash_attention_for_cpu.default: _no_attention_dropout(3),
    aten._scaled_dot_product_flash_attention.default: _no_attention_dropout(3),
    aten._scaled_dot_product_efficient_attention.default: _no_attention_dropout(5),
    aten.batch_norm.default: _with_running_stats(5, "training"),
    aten.native_batch_norm.default: _with_running_stats(5, "training"),
    aten._native_batch_norm_legit_functional.default: _with_running_stats(5, "training"),
    aten.instance_norm.default: _with_running_stats(5, "use_input_stats"),
    bn_ops.batch_norm_sync: _to_aten_norm(aten.batch_norm.default, False),
    bn_ops.batch_norm_local: _to_aten_norm(aten.batch_norm.default, False),
    bn_ops.instance_norm_sync: _to_aten_norm(aten.instance_norm.default, False),
    bn_ops.instance_norm_local: _to_aten_norm(aten.instance_norm.default, False),
    aten.add_.Tensor: _drop_batch_count,
    **{getattr(aten, rnn).input: _set_arg(6, "train") for rnn in ("lstm", "gru", "rnn_tanh", "rnn_relu")},
    **{getattr(aten, rnn).data: _set_arg(7, "train") for rnn in ("lstm", "gru", "rnn_tanh", "rnn_relu")},
}
"""Training-dependent op -> its eval-mode rewrite (see the module docstring)."""


def eval_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` as it runs in eval mode: ``gm`` itself when no op depends on the mode, else a copy
    of its graph rewritten by :data:`EVAL_RULES` that shares ``gm``'s tensors and submodules."""
    out = clone_graph_module(gm)
    changed = False
    for node in list(out.graph.nodes):
        rule = EVAL_RULES.get(node.target) if node.op == "call_function" else None
        if rule is not None:
            changed |= rule(node)
    if not changed:
        return gm
    out.graph.lint()
    out.recompile()
    return out


def _signature(gm: torch.fx.GraphModule, kept: set[int]) -> list[tuple[torch.fx.Node, tuple[Any, ...]]]:
    """The graph's computation in order, each node with its call, values named by position (node
    names differ between captures): what two captures of one model in one mode agree on. ``kept``:
    the ids of the capture's parameters and buffers, whose values are not digested."""
    index: dict[torch.fx.Node, int] = {}

    def norm(a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda n: ("%", index[n]))

    out: list[tuple[torch.fx.Node, tuple[Any, ...]]] = []
    for node in gm.graph.nodes:
        if node.target in _LAYOUT_ONLY:  # the value of its input: a kernel's output layout may differ by mode
            index[node] = index[node.args[0]]
            continue
        index[node] = len(out)
        target = node.target if node.op in ("call_function", "call_method", "get_attr", "call_module") else None
        args, kwargs = _with_defaults(node)
        value = _constant_digest(gm, node, kept) if node.op == "get_attr" else None
        out.append((node, (node.op, str(target), norm(args), norm(kwargs), value)))
    return out


def _state_ids(gm: torch.fx.GraphModule) -> set[int]:
    """The ids of a capture's parameters and buffers, read before :func:`eval_graph` copies it: the
    copy (``torch.fx.GraphModule``) registers every tensor it reads as a buffer, the constants the
    trace baked in too, whose values would then go unchecked in the training graph and be compared
    with a digest in the other (every model with a constant, GPT-2's empty KV cache, was refused)."""
    return {id(t) for t in (*gm.parameters(), *gm.buffers())}


def _constant_digest(gm: torch.fx.GraphModule, node: torch.fx.Node, kept: set[int]) -> tuple[Any, ...] | None:
    """The value of a tensor the trace baked into the graph (neither a parameter nor a buffer):
    numbers the forward computed in Python differ between the modes where its code does (HF
    BigBird's random blocks, drawn with numpy only in training); None for other attributes."""
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    if not isinstance(value, torch.Tensor) or id(value) in kept:
        return None
    if value.device.type == "meta":
        return (tuple(value.shape), str(value.dtype))
    data = value.detach().cpu().contiguous().reshape(-1)
    return (tuple(value.shape), str(value.dtype), hashlib.sha1(data.view(torch.uint8).numpy().tobytes()).hexdigest())


_LAYOUT_ONLY = (aten.contiguous.default,)
"""Ops that change a tensor's layout, not its values: traced only where the input's layout needs
them (SDPA with dropout returns another layout than without), so they are not compared."""


def _with_defaults(node: torch.fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """An aten call's arguments in schema order with defaults filled in (``sdpa(q, k, v)`` and
    ``sdpa(q, k, v, None, 0.0)`` are one call); other calls as they are."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return tuple(node.args), dict(node.kwargs)
    values = []
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            values.append(node.args[i])
        elif arg.name in node.kwargs:
            values.append(node.kwargs[arg.name])
        else:
            values.append(arg.default_value if arg.has_default_value() else None)
    return tuple(values), {}


def eval_difference(train: torch.fx.GraphModule, evaluated: torch.fx.GraphModule) -> str | None:
    """None when ``train`` (a capture in training mode), rewritten by :func:`eval_graph`, computes
    what ``evaluated`` (a capture of the same model in eval mode) does; else where they part: the
    model's Python code takes another path in eval mode (``if self.training: ...``)."""
    a, b = _signature(eval_graph(train), _state_ids(train)), _signature(eval_graph(evaluated), _state_ids(evaluated))
    for (node_a, x), (node_b, y) in zip(a, b):
        if x[:4] == y[:4] and x != y:
            return (f"the tensor {node_a.target} that the trace baked into the graph (numbers the forward computes "
                    "outside torch, such as numpy draws) holds other values in eval mode")
        if x != y:
            return f"in training mode it runs {_describe(node_a)}, in eval mode {_describe(node_b)}"
    if len(a) != len(b):
        longer, mode = (a, "training") if len(a) > len(b) else (b, "eval")
        return f"only in {mode} mode it runs {_describe(longer[min(len(a), len(b))][0])}"
    return None


def _describe(node: torch.fx.Node) -> str:
    """The op and the user's source line that made it (``passes.tp.rewrite.source_of``)."""
    return f"{node.op} {getattr(node.target, '__name__', node.target)}{source_of(node)}"
