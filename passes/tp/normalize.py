"""Bring a torch-level fx graph to the ATen form the tensor-parallel rules read.

``planner.capture`` traces models on ``meta`` with ``torch.fx`` (``planner.fx_capture``): its nodes
are ``call_method`` (``x.view(b, t, h, d)``, ``x.split(n, dim=2)``) and torch-level
``call_function`` (``F.linear``, ``operator.add``, an opaque loss function). The rules (and the
pattern detector) are written once, for the ATen ops ``torch.export`` produces. This pass retraces
each such node on its own with ``make_fx(pre_dispatch=True)`` (the same ATen level as export's
training IR: ``aten.linear``, ``aten.scaled_dot_product_attention``, ``aten.cross_entropy_loss``)
on meta tensors of its recorded shapes and splices the ATen nodes in its place.

Shapes are static in a captured graph, so the arguments that fx computed from ``x.shape`` are
taken from the nodes' recorded values (``node.meta["val"]``); the shape arithmetic then has no
users and is dropped. Retraces are cached by signature (op, argument structure, shapes, dtypes,
constants): a transformer's blocks repeat, so a 128-layer model costs about one block's worth.

A node that cannot be retraced (no recorded values, an op without a meta kernel, several outputs
that are not one op's) stays as it is; the rules then treat it as an op without a rule (replicated
inputs and output), which is always correct. Node meta of the original (``fs_module``, ``fs_layer``,
``nn_module_stack``, ``stack_trace``) is copied onto the nodes that replace it; their ``val`` are
meta tensors from the retrace.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx
from torch.fx import Node

from passes.graph_utils import per_graph
from passes.split_stages import META_STAGE, META_STAGES
from planner.fx_module import graph_module
from planner.graph import META_LAYER, META_MODULE, META_PARAM, ancestors

__all__ = ["needs_normalizing", "to_aten"]

_KEEP_META = (META_MODULE, META_LAYER, "nn_module_stack", "stack_trace", META_STAGE, META_STAGES)
_SHAPE_MATH = {getattr, operator.getitem, operator.floordiv, operator.mul, operator.add, operator.sub,
               operator.truediv, operator.mod, operator.neg, len}


def _is_aten(target: Any) -> bool:
    return isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator))


_TRANSPOSES = {torch.ops.aten.numpy_T.default, torch.ops.aten.t.default, torch.ops.aten.transpose.int,
               torch.ops.aten.permute.default}
_MATMULS = {torch.ops.aten.matmul.default, torch.ops.aten.mm.default}


def _transposed_param(node: Any) -> Node | None:
    """The 2-D parameter ``w`` when ``node`` is ``w.T`` (``numpy_T``, ``t``, ``transpose(0, 1)``,
    ``permute([1, 0])``), else None."""
    if not (isinstance(node, Node) and node.op == "call_function" and node.target in _TRANSPOSES):
        return None
    w = node.args[0]
    if not (isinstance(w, Node) and w.op == "get_attr" and META_PARAM in w.meta):
        return None
    v = w.meta.get("val")
    if not isinstance(v, torch.Tensor) or v.dim() != 2:
        return None
    args: Any = node.args  # (w, dim0, dim1) for transpose, (w, dims) for permute, (w,) otherwise
    if node.target == torch.ops.aten.transpose.int and sorted(d % 2 for d in args[1:3]) != [0, 1]:
        return None
    if node.target == torch.ops.aten.permute.default and [d % 2 for d in args[1]] != [1, 0]:
        return None
    return w


def _is_weight_transpose_matmul(node: Node) -> bool:
    """``x @ w.T`` with a 2-D parameter ``w`` (Falcon's ``FalconLinear``): ``linear(x, w)``."""
    return node.op == "call_function" and node.target in _MATMULS and len(node.args) == 2 and \
        _transposed_param(node.args[1]) is not None and isinstance(node.args[0], Node)


def needs_normalizing(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` holds torch-level nodes (fx capture) or ``x @ w.T`` matmuls that
    :func:`to_aten` would rewrite."""
    for node in gm.graph.nodes:
        if _is_weight_transpose_matmul(node):
            return True
        if node.op == "call_method":
            return True
        if node.op == "call_function" and not _is_aten(node.target) and node.target is not operator.getitem \
                and isinstance(node.meta.get("val"), torch.Tensor):
            return True
    return False


@per_graph
def to_aten(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` with its torch-level nodes retraced to ATen (see the module docstring); ``gm``
    itself when it has none. Parameters are shared with ``gm``; ``gm.meta`` is copied.

    The copy is made once per graph and shared (``passes.graph_utils.per_graph``: the TP detector
    and the planner's compile check both bring the search's capture to ATen): callers must not
    change it, as no pass does."""
    if not needs_normalizing(gm):
        return gm
    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    env: dict[Node, Node] = {}
    cache: dict[Any, _Template | None] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            out = graph.output(torch.fx.node.map_arg(node.args[0], env.__getitem__), type_expr=node.type)
            out.meta = dict(node.meta)
            continue
        new = _retrace(graph, node, env, cache) if node.op in ("call_function", "call_method") else None
        if new is None:
            new = graph.node_copy(node, env.__getitem__)
        env[node] = new
    _linear_from_transposed_weights(graph)
    _drop_dead_shape_math(graph)
    graph.lint()
    out_gm = graph_module(gm, graph, class_name=type(gm).__name__)
    out_gm.meta = dict(gm.meta)
    return out_gm


def _retrace(graph: torch.fx.Graph, node: Node, env: dict[Node, Node],
             cache: dict[Any, _Template | None]) -> Node | None:
    val = node.meta.get("val")
    if node.op == "call_function" and _is_aten(node.target):
        return None
    if not _tensor_valued(val):
        return None
    tensors: list[Node] = []
    consts_ok = [True]

    def slot(a: Any) -> Any:
        if isinstance(a, Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                tensors.append(a)
                return _Slot(len(tensors) - 1)
            if v is None or isinstance(v, (torch.Tensor, tuple, list)) and _tensor_valued(v):
                consts_ok[0] = False
            return v  # an int / float / dtype / shape computed from recorded shapes
        return a

    args = torch.fx.node.map_aggregate(node.args, slot)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, slot)
    if not consts_ok[0]:
        return None
    specs = tuple((tuple(int(s) for s in t.meta["val"].shape), t.meta["val"].dtype) for t in tensors)
    try:
        key = (node.op, node.target, repr(args), repr(kwargs), specs)
        hash(key)
    except TypeError:
        return None
    if key not in cache:
        cache[key] = _template(_trace_one(node.op, node.target, args, kwargs, specs))
    template = cache[key]
    if template is None:
        return None
    return _splice(graph, template, [env[t] for t in tensors], node)


class _Slot:
    """The i-th tensor argument of a retraced node (a placeholder of its template)."""

    def __init__(self, i: int) -> None:
        self.i = i

    def __repr__(self) -> str:
        return f"<tensor {self.i}>"


def _tensor_valued(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (tuple, list)) and bool(val) and all(isinstance(v, torch.Tensor) for v in val)


def _trace_one(op: str, target: Any, args: Any, kwargs: Any,
               specs: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> torch.fx.GraphModule | None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def fill(tree: Any, tensors: tuple[torch.Tensor, ...]) -> Any:
        return torch.fx.node.map_aggregate(tree, lambda a: tensors[a.i] if isinstance(a, _Slot) else a)

    def call(*tensors: torch.Tensor) -> Any:
        a, k = fill(args, tensors), fill(kwargs, tensors)
        if op == "call_method":
            return getattr(a[0], target)(*a[1:], **k)
        fn: Callable[..., Any] = target
        return fn(*a, **k)

    inputs = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in specs]
    try:
        return make_fx(call, pre_dispatch=True)(*inputs)
    except Exception:  # noqa: BLE001 - an op that cannot be retraced stays as it is (replicated by the rules)
        return None


@dataclass(frozen=True)
class _Template:
    """A retraced op, ready to copy: its placeholders, the nodes its result needs in order, and
    the node standing for its value."""

    placeholders: list[Node]
    body: list[Node]
    result: Node


def _template(gm: torch.fx.GraphModule | None) -> _Template | None:
    """What :func:`_splice` copies of a traced op, or None when it cannot stand for the node (several
    outputs that are not one op's getitems in order, or a constant it would read)."""
    if gm is None:
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    result = out_node.args[0]
    if isinstance(result, (tuple, list)):
        # several outputs must be the getitems of one op (split, chunk) in order: that op stands for them
        srcs = {r.args[0] for r in result if isinstance(r, Node) and r.target is operator.getitem}
        if len(srcs) != 1 or [r.args[1] for r in result] != list(range(len(result))):
            return None
        (result,) = srcs
    if not isinstance(result, Node) or any(n.op == "get_attr" for n in gm.graph.nodes):
        return None
    needed = set(ancestors(result))
    body = [n for n in gm.graph.nodes if n in needed and n.op != "placeholder"]
    return _Template(placeholders=placeholders, body=body, result=result)


def _splice(graph: torch.fx.Graph, template: _Template, inputs: list[Node], like: Node) -> Node:
    """Copy ``template``'s nodes into ``graph`` on ``inputs``; the node standing for ``like``'s value."""
    env: dict[Node, Node] = dict(zip(template.placeholders, inputs))
    keep = {k: like.meta[k] for k in _KEEP_META if k in like.meta}
    for n in template.body:
        new = graph.node_copy(n, env.__getitem__)
        new.meta = {"val": n.meta["val"], **keep} if "val" in n.meta else dict(keep)
        env[n] = new
    return env[template.result]  # an input itself when the op returned it unchanged (x.float() of a float x)


def _linear_from_transposed_weights(graph: torch.fx.Graph) -> None:
    """``matmul(x, w.T)`` -> ``linear(x, w)`` for a 2-D parameter ``w``: the same product, seen as the
    ``nn.Linear``-kind weight it is (Falcon's ``FalconLinear``), so the tensor-parallel styles apply."""
    for node in list(graph.nodes):
        if not _is_weight_transpose_matmul(node):
            continue
        transposed = node.args[1]
        w = _transposed_param(transposed)
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.aten.linear.default, (node.args[0], w))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        if not transposed.users:
            graph.erase_node(transposed)


def _drop_dead_shape_math(graph: torch.fx.Graph) -> None:
    """Remove the shape arithmetic (``x.shape``, ``x.size(1)``, ``t // h``) nothing reads any more."""
    changed = True
    while changed:
        changed = False
        for n in reversed(list(graph.nodes)):
            if n.users or n.op not in ("call_function", "call_method"):
                continue
            pure = (n.op == "call_function" and n.target in _SHAPE_MATH) or \
                (n.op == "call_method" and n.target in ("size", "dim"))
            if pure and not isinstance(n.meta.get("val"), torch.Tensor):
                graph.erase_node(n)
                changed = True
