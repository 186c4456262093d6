"""The graph builder behind ``shard_tensor_parallel_pass``: placements, conversions, emission.

:class:`Rewriter` copies the single-device graph node by node into a new graph. For every value it
knows the :class:`~passes.tp.placement.Placement` of the rank-local tensor it emitted. An op rule
(``passes.tp.rules``) asks for its inputs in the placements it can compute on; the rewriter inserts
the collective that converts each input, once per (value, placement)::

    from \\ to   R                      S(d)                         P
    R          -                      scatter_to_group (no comm)   (never)
    S(d)       gather_from_group      via R                        (never)
    P          reduce_from_group      reduce_scatter_seq           -

and, when the op's output is not replicated, wraps every replicated input that carries a gradient
in ``copy_to_group`` (identity forward, all-reduce backward): such an input's gradient is a sum
over the ranks' pieces of the computation (Megatron's "f"; for norm weights in sequence-parallel
regions, Korthikanti et al. 2022 section 4.2.2).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.fx
from torch.fx import Node

from passes.ops import comm
from passes.graph_utils import local_fake
from passes.tp.placement import Placement, R, S, local_shape
from planner.graph import META_LAYER, META_MODULE, META_PARAM
from planner.modpath import fetch_attr

__all__ = ["Rewriter", "TPShardError", "META_TP", "META_TP_COMM", "META_TP_GLOBAL_SHAPE", "META_TP_FALLBACK", "args_of",
           "fmt", "source_of"]

META_TP = "fs_tp"
"""str on every rewritten node: the placement of its rank-local value (``R``, ``S(2)``, ``P``)."""
META_TP_COMM = "fs_tp_comm"
"""str on inserted collective nodes: why it was inserted (``"P->R for add_6"``)."""
META_TP_GLOBAL_SHAPE = "fs_tp_global_shape"
"""tuple on rewritten nodes whose rank-local value is a slice: the shape of the whole value."""
META_TP_FALLBACK = "fs_tp_fallback"
"""True on ops run replicated for lack of a rule (``passes.tp.rules.fallback``)."""

_CASTS = {torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default}
_COPY_META = (META_MODULE, META_LAYER, "nn_module_stack", "stack_trace", META_PARAM)


class TPShardError(ValueError):
    """The tensor-parallel pass cannot shard a node correctly; the message quotes the node."""

    node: Node | None = None
    """The node being rewritten when the error was raised (set by the pass)."""


def args_of(node: Node) -> Any:
    """``node.args`` typed loosely: fx types them as any argument, rules know what they hold."""
    return node.args


def fmt(node: Node | None) -> str:
    """``view_1 = aten.view.default(linear, [2, 16, 2, 16])``: the op and its operands, for messages."""
    if node is None:
        return "<no node>"
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    if isinstance(node.target, torch._ops.OpOverload):
        target = str(node.target)  # aten.view.default
    operands = ", ".join(_operand(a) for a in node.args)
    return f"{node.name} = {target}({operands})"


def _operand(a: Any) -> str:
    if isinstance(a, Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_operand(x) for x in a)
        return f"[{inner}]"
    return repr(a)


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OWN = (os.path.join(_REPO, "planner") + os.sep, os.path.join(_REPO, "passes") + os.sep,
        os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def source_of(node: Node | None) -> str:
    """`` at file.py:12 (code)``: the user's line that made ``node`` (the innermost frame of its
    recorded stack trace outside torch and this package), `` in the loss function`` for ops of a
    ``loss_fn`` (export records only module frames), or "" when capture recorded nothing."""
    trace = node.meta.get("stack_trace") if node is not None else None
    if not trace:
        return ""
    frames = []
    lines = [ln.strip() for ln in str(trace).strip().splitlines()]
    for i, line in enumerate(lines):
        if line.startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            frames.append((line, code))
    for line, code in reversed(frames):
        path = line.split('"')[1] if '"' in line else line
        if path.startswith(_OWN):
            continue
        lineno = line.split("line ")[1].split(",")[0] if "line " in line else "?"
        return f" at {os.path.basename(path)}:{lineno}" + (f" ({code})" if code else "")
    if any("loss_fn" in code for _, code in frames):
        return " in the loss function"
    return ""


class Rewriter:
    """State of one rewrite: old graph -> new graph, with placements and conversion caches."""

    def __init__(self, gm: torch.fx.GraphModule, *, tp: int, index: int, axis: str, sequence_parallel: bool,
                 seq_dim: int, params: dict[str, Placement], styles: dict[Node, str]) -> None:
        self.gm, self.tp, self.index, self.axis = gm, tp, index, axis
        self.sp, self.seq_dim = sequence_parallel, seq_dim
        self.params = params  # get_attr target -> placement of its local tensor
        self.styles = styles  # old call_function node -> tp style of its module
        self.graph = torch.fx.Graph()
        self.env: dict[Node, Node] = {}
        self.place: dict[Node, Any] = {}
        self.conv: dict[tuple[Node, Placement], Node] = {}
        self.copies: dict[Node, Node] = {}
        self.grad: dict[Node, bool] = {}
        self.strict: dict[Node, Node] = {}  # old value -> vocab_loss node whose shard must not be gathered
        self.cur: Node | None = None

    # ------------------------------------------------------------------ facts about old nodes

    def val(self, node: Any) -> Any:
        return node.meta.get("val") if isinstance(node, Node) else None

    def shape(self, node: Node) -> list[int]:
        v = self.val(node)
        if not isinstance(v, torch.Tensor):
            raise TPShardError(f"no tensor shape recorded for {fmt(node)} (node.meta['val'] missing); "
                               "run the pass on a graph from planner.capture")
        # a size from the data (MoE routing's nonzero) stays symbolic: replicated values never split it
        return [s if isinstance(s, torch.SymInt) else int(s) for s in v.shape]

    def ndim(self, node: Node) -> int:
        return len(self.shape(node))

    def is_tensor(self, node: Any) -> bool:
        return isinstance(node, Node) and isinstance(self.val(node), torch.Tensor)

    def p(self, node: Node) -> Placement:
        got = self.place.get(node)
        if not isinstance(got, Placement):
            raise TPShardError(f"{fmt(node)} has no single placement (it is {got!r})")
        return got

    def compute_grad(self, node: Node) -> bool:
        """Whether ``node``'s value can carry a gradient (decides where copy_to_group is needed)."""
        if node.op == "get_attr":
            attr = fetch_attr(self.gm, str(node.target))
            return isinstance(attr, torch.Tensor) and attr.requires_grad
        if node.op == "placeholder":
            v = self.val(node)  # stage inputs may be activations: any float input may carry a gradient
            return isinstance(v, torch.Tensor) and v.is_floating_point()
        if node.op != "call_function":
            return False
        if "wrap_with_set_grad_enabled" in str(node.target) and node.args and node.args[0] is False:
            return False
        v = self.val(node)
        floats = v.is_floating_point() if isinstance(v, torch.Tensor) else isinstance(v, (tuple, list))
        return floats and any(self.grad.get(a, False) for a in node.all_input_nodes)

    # ------------------------------------------------------------------ emission

    def emit(self, target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, *,
             place: Any, like: Node | None = None, comm_why: str | None = None) -> Node:
        like = like or self.cur
        new = self.graph.call_function(target, tuple(args), dict(kwargs or {}))
        if like is not None:
            for key in _COPY_META:
                if key in like.meta and key != META_PARAM:
                    new.meta[key] = like.meta[key]
        new.meta[META_TP] = str(place) if isinstance(place, Placement) else [str(p) for p in place or []]
        if comm_why:
            new.meta[META_TP_COMM] = comm_why
        return new

    def set_local_val(self, new: Node, old: Node, place: Any) -> None:
        """Record the rank-local shape of ``new`` in ``meta['val']`` (a FakeTensor like capture's)."""
        v = self.val(old)
        if isinstance(v, torch.Tensor) and isinstance(place, Placement):
            new.meta["val"] = local_fake(v, local_shape(v.shape, place, self.tp))
            new.meta[META_TP_GLOBAL_SHAPE] = tuple(s if isinstance(s, int) else str(s) for s in v.shape)
        elif isinstance(v, (tuple, list)) and isinstance(place, list):
            new.meta["val"] = type(v)(
                local_fake(x, local_shape(x.shape, pl, self.tp)) if isinstance(x, torch.Tensor) and pl else x
                for x, pl in zip(v, place))

    # ------------------------------------------------------------------ conversions

    def boundary_place(self, node: Node) -> Placement:
        """How a value crossing a pipeline-stage boundary travels: under sequence parallelism a
        floating-point activation of 3+ dims whose sequence divides by tp goes as its sequence shard
        (Megatron-LM sends the sequence-parallel shard between stages), anything else whole. Sender
        and receiver apply this rule to the same captured shape, so they agree without talking."""
        if self.sp and self.is_tensor(node) and self.val(node).is_floating_point():
            shape = self.shape(node)
            if len(shape) >= 3 and shape[self.seq_dim] % self.tp == 0:
                return S(self.seq_dim)
        return R

    def resolve_target(self, node: Node) -> Placement:
        """Where a partial sum goes when a consumer needs it whole: the sequence shard under
        sequence parallelism (3-D activations whose sequence divides by tp), else replicated."""
        if self.sp and self.is_tensor(node):
            shape = self.shape(node)
            if len(shape) >= 3 and shape[self.seq_dim] % self.tp == 0:
                return S(self.seq_dim)
        return R

    def get(self, node: Any, want: Placement | None) -> Any:
        """The new-graph value of old ``node`` in placement ``want`` (None: as it is)."""
        if not isinstance(node, Node):
            return node
        have = self.place.get(node)
        if want is None or not isinstance(have, Placement) or have == want:
            return self.env[node]
        key = (node, want)
        if key in self.conv:
            return self.conv[key]
        if have.is_p and self._reduce_before_cast(node):
            # a cast commutes with the sum: reduce its source (once, shared with the source's other
            # consumers; HF's RMSNorm reads hidden.to(float32) while the residual reads hidden)
            base = self.get(args_of(node)[0], want)
            cast: Any = node.target
            out = self.emit(cast, (base, *args_of(node)[1:]), dict(node.kwargs), place=want, like=node)
            self.set_local_val(out, node, want)
            self.conv[key] = out
            self.env[node], self.place[node] = out, want
            return out
        why = f"{have}->{want} for {self.cur.name if self.cur is not None else '?'}"
        x = self.env[node]
        if have.is_p:
            if want.is_r:
                out = self.emit(comm.reduce_from_group, (x, self.axis), place=want, like=node, comm_why=why)
            elif want.is_s and want.parts == 1:
                out = self.emit(comm.reduce_scatter_seq, (x, self.axis, want.dim), place=want, like=node, comm_why=why)
            else:
                raise TPShardError(f"cannot turn partial sum {fmt(node)} into {want} (needed by {fmt(self.cur)})")
        elif have.is_s:
            if want.is_p:
                raise TPShardError(f"cannot turn shard {fmt(node)} into a partial sum (needed by {fmt(self.cur)})")
            if have.parts != 1:
                raise TPShardError(
                    f"{fmt(self.cur)} needs the fused value {fmt(node)} ({have}) whole; only split/chunk into "
                    f"its {have.parts} blocks, elementwise ops and views are supported on it")
            if node in self.strict:
                raise TPShardError(
                    f"vocab_loss on {fmt(self.strict[node])}: its vocab-sharded output would be gathered at "
                    f"{fmt(self.cur)}; the logits must reach cross_entropy (or log_softmax + nll_loss). Use "
                    "'colwise' or 'colwise_gather' if a gather is intended")
            gathered = self.get(node, R) if want.is_s else None
            if gathered is not None:
                out = self.emit(comm.scatter_to_group, (gathered, self.axis, want.dim), place=want, like=node,
                                comm_why=why)
            else:
                out = self.emit(comm.gather_from_group, (x, self.axis, have.dim), place=want, like=node,
                                comm_why=why)
        else:  # have R
            if not want.is_s or want.parts != 1:
                raise TPShardError(f"cannot turn replicated {fmt(node)} into {want} (needed by {fmt(self.cur)})")
            if self.shape(node)[want.dim] % self.tp:
                raise TPShardError(f"{fmt(self.cur)} needs {fmt(node)} split along dim {want.dim} of size "
                                   f"{self.shape(node)[want.dim]}, which does not divide by tp={self.tp}")
            out = self.emit(comm.scatter_to_group, (x, self.axis, want.dim), place=want, like=node, comm_why=why)
        self.set_local_val(out, node, want)
        self.conv[key] = out
        if have.is_p:
            # a partial sum is reduced once: later consumers see the reduced value, not the partial
            self.env[node], self.place[node] = out, want
        return out

    def _reduce_before_cast(self, node: Node) -> bool:
        """Whether the partial sum ``node`` is a dtype cast (of a partial sum: casts stay partial only
        on one) whose source had better be reduced instead: the source is read by other ops too (it
        may have been reduced for them already), or is no wider than the cast."""
        if node.op != "call_function" or node.target not in _CASTS:
            return False
        src = args_of(node)[0]
        if not (isinstance(src, Node) and self.is_tensor(src)):
            return False
        readers = [u for u in src.users if u is not node and "_assert_tensor_metadata" not in str(u.target)]
        return bool(readers) or self.val(src).element_size() <= self.val(node).element_size()

    def copied(self, new: Node, old: Node) -> Node:
        """``copy_to_group(new)``: the replicated input of a sharded computation (grad all-reduced)."""
        if new not in self.copies:
            out = self.emit(comm.copy_to_group, (new, self.axis), place=R, like=old,
                            comm_why=f"replicated input of sharded {self.cur.name if self.cur is not None else '?'}")
            if "val" in new.meta:
                out.meta["val"] = new.meta["val"]
            self.copies[new] = out
        return self.copies[new]

    def map_args(self, args: Any, want: dict[Node, Placement], out: Any) -> Any:
        """``args`` (old nodes and constants) in the new graph: each input converted to
        ``want[input]`` (its current placement if absent), and replicated inputs with a gradient
        wrapped in ``copy_to_group`` when the output ``out`` is not replicated."""
        sharded_out = _any_not_r(out)

        def one(a: Any) -> Any:
            if not isinstance(a, Node):
                return a
            new = self.get(a, want.get(a))
            final = want.get(a) or self.place.get(a)
            if sharded_out and isinstance(final, Placement) and final.is_r and self.grad.get(a, False):
                return self.copied(new, a)
            return new

        return torch.fx.node.map_aggregate(args, one)

    def finish(self, node: Node, want: dict[Node, Placement], out: Any, *, target: Any = None,
               args: tuple[Any, ...] | None = None, kwargs: dict[str, Any] | None = None) -> Node:
        """Emit ``node`` (optionally with another target, or args whose constants were rewritten for
        local shapes; old nodes in them are converted) on converted inputs."""
        new_args = self.map_args(node.args if args is None else args, want, out)
        new_kwargs = self.map_args(node.kwargs if kwargs is None else kwargs, want, out)
        new = self.emit(target or node.target, new_args, new_kwargs, place=out)  # type: ignore[arg-type]
        self.set_local_val(new, node, out)
        return new

    def tensor_inputs(self, node: Node) -> list[Node]:
        """The distinct tensor inputs of ``node`` (fx's de-duplicated ``all_input_nodes``): for
        converting every input. A rule that reasons about *how many* operands are partial or
        sharded must use :meth:`operands`, which keeps repeats (``mul(x, x)`` is not linear in x)."""
        return [a for a in node.all_input_nodes if self.is_tensor(a)]

    def operands(self, node: Node) -> list[Node]:
        """Every tensor operand of ``node`` in argument order (positional, then keyword, through
        nested lists), one entry per occurrence: ``mul(x, x)`` gives ``[x, x]``."""
        out: list[Node] = []

        def visit(a: Any) -> Any:
            if self.is_tensor(a):
                out.append(a)
            return a

        torch.fx.node.map_aggregate((node.args, node.kwargs), visit)
        return out


def _any_not_r(place: Any) -> bool:
    if isinstance(place, Placement):
        return not place.is_r
    if isinstance(place, (list, tuple)):
        return any(_any_not_r(p) for p in place)
    return False
