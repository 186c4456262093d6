"""Buffers the model's forward writes in place (a step counter, an EMA of activations), found in a graph.

One process runs the forward once per step on the whole batch, so such a buffer is updated once, from
the whole batch. Data parallelism runs it on every dp rank's slice, and microbatching once per
microbatch: a counter advances ``microbatches`` times per step, an EMA of a batch mean averages
slices (each dp rank its own, so the ranks' copies part, and the checkpoint keeps rank 0's). The
runtime cannot merge arbitrary updates, so plans that cut the batch are refused for such models,
naming the buffer and the line that writes it::

    for w in find_buffer_writes(graph.gm):
        print(w.buffer, w.source)        # ema  model.py:14 `self.ema.mul_(0.9).add_(0.1 * h.mean(0))`

Batch statistics' running buffers (BatchNorm, InstanceNorm) are not counted here: ``passes.dp.batch_norm``
synchronizes them (``planner.batch_stats``).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn

from planner.batch_stats import find_batch_stat_ops, source_line
from planner.graph import META_MODULE, bodies
from planner.plan import KEEP_BATCH_WHOLE

__all__ = ["BufferWrite", "find_buffer_writes", "buffer_write_problem", "written_attrs", "writes_differ",
           "written_in_place"]

_PREFIX = "model."  # the capture's root holds the user's model as ``model`` (planner.capture)


@dataclass(frozen=True)
class BufferWrite:
    """One in-place write of the forward to a buffer (or a parameter: a momentum encoder's EMA) of the model."""

    buffer: str
    """The tensor's name in the user's model (``model.state_dict()`` key)."""
    module: str
    """Path of the module whose code writes it ('' = the model itself)."""
    source: str
    """The user's line that writes it (``model.py:14 `...```), or '' when not recorded."""
    parameter: bool = False
    """A parameter, not a buffer (a momentum teacher's EMA of its weights, MoCo's and DINO's habit)."""
    trainable: bool = False
    """A parameter that needs a gradient (the optimizer trains it, and the forward writes it too)."""
    from_rows: bool = True
    """The value written depends on the batch or on a random draw (an EMA of activations, DINO's
    center); False for a step counter or an EMA of the model's own weights, which every dp rank
    computes alike from its replica."""
    op: str = ""
    """The in-place op that writes it (``aten.mul_.Tensor``), '' when not recorded."""

    def describe(self) -> str:
        """``vq.embed (model.py:31 `...`) at module vq, op aten.copy_.default``: what a refusal names."""
        site = f" at module {self.module or '<model top level>'}" + (f", op {self.op}" if self.op else "")
        return f"{self.buffer}{' (' + self.source + ')' if self.source else ''}{site}"


def find_buffer_writes(gm: torch.fx.GraphModule) -> list[BufferWrite]:
    """Every buffer (or parameter) an in-place aten op of ``gm`` writes (the op's first argument,
    through the chain of in-place results), except batch statistics' running buffers, one entry per
    tensor. The bodies of higher-order ops are searched too: export puts a ``with torch.no_grad():``
    block (an aux-loss-free router's bias update, DINO's center, a momentum teacher's EMA of its
    weights) in ``wrap_with_set_grad_enabled``'s body, whose placeholders are the operands that follow it."""
    root: dict[torch.fx.Node, str] = {}  # node -> the buffer or parameter it aliases
    parameters: set[str] = set()
    trainable: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _fetch(gm, str(node.target))
            if isinstance(value, torch.Tensor):
                root[node] = str(node.target)
                if isinstance(value, nn.Parameter):
                    parameters.add(str(node.target))
                    if value.requires_grad:
                        trainable.add(str(node.target))
    out: dict[str, BufferWrite] = {}
    _collect(gm, root, out, "", parameters=parameters, seeds=None)
    if not out:  # the usual case, and the only graph walk then (a 1T model's capture is large)
        return []
    stat_modules = {op.module for op in find_batch_stat_ops(gm)}
    return [dataclasses.replace(w, trainable=_PREFIX + w.buffer in trainable or w.buffer in trainable)
            for w in out.values() if w.buffer.rpartition(".")[0] not in stat_modules]


def written_attrs(gm: torch.fx.GraphModule) -> set[str]:
    """The get_attr targets of every buffer ``gm`` writes in place (batch statistics' included), in
    its own graph or a higher-order op's body: what a rank graph must own rather than share with the
    model it was captured from (``passes.dp.graph.rebuild``)."""
    root = {n: str(n.target) for n in gm.graph.nodes if n.op == "get_attr"
            and isinstance(v := _fetch(gm, str(n.target)), torch.Tensor) and not isinstance(v, nn.Parameter)}
    out: dict[str, BufferWrite] = {}
    _collect(gm, root, out, "", raw=True)
    return set(out)


def _varying(gm: torch.fx.GraphModule, seeds: set[torch.fx.Node] | None) -> set[torch.fx.Node]:
    """The nodes of ``gm`` whose value can differ between dp ranks or microbatches: those computed
    from ``seeds`` (default: every placeholder, the batch's inputs) or from a random draw."""
    out: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        seeded = _draws(node, gm)
        if (node in seeds if seeds is not None else node.op == "placeholder") or seeded \
                or any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _draws(node: torch.fx.Node, owner: torch.fx.GraphModule) -> bool:
    """Whether ``node`` draws random numbers, itself or in a higher-order op's body (``torch.randn``
    under ``torch.no_grad()``: export puts it in ``wrap_with_set_grad_enabled``'s body)."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()) or any(
        _draws(n, body) for body in bodies(node, owner) for n in body.graph.nodes)


def _collect(gm: torch.fx.GraphModule, root: dict[torch.fx.Node, str], out: dict[str, BufferWrite],
             module: str, *, raw: bool = False, parameters: frozenset[str] | set[str] = frozenset(),
             seeds: set[torch.fx.Node] | None = None) -> None:
    """:func:`find_buffer_writes`' walk of one graph, ``root`` mapping its nodes to the tensors they
    alias (``parameters``: those that are parameters); ``module``: the higher-order op's module, for
    a body whose nodes record none; ``raw``: ``out`` keyed by the get_attr target (else by the user's
    name); ``seeds``: the placeholders that vary with the batch (:func:`_varying`; None: all)."""
    bodies = {n: v for n in gm.graph.nodes if n.op == "get_attr"
              and isinstance(v := _fetch(gm, str(n.target)), torch.fx.GraphModule)}
    moving: list[set[torch.fx.Node]] = []  # _varying(gm, seeds), made at the first write or body

    def varies(node: torch.fx.Node) -> bool:
        if not moving:
            moving.append(_varying(gm, seeds))
        return node in moving[0]

    for node in gm.graph.nodes:
        if node.op != "call_function" or not node.args:
            continue
        body_at = next((i for i, a in enumerate(node.args) if isinstance(a, torch.fx.Node) and a in bodies), None)
        if body_at is not None:
            body = bodies[node.args[body_at]]
            holders = [n for n in body.graph.nodes if n.op == "placeholder"]
            inner = {h: root[a] for h, a in zip(holders, node.args[body_at + 1:]) if isinstance(a, torch.fx.Node)
                     and a in root}
            if inner:
                held = {h for h, a in zip(holders, node.args[body_at + 1:]) if isinstance(a, torch.fx.Node)
                        and varies(a)}
                _collect(body, inner, out, str(node.meta.get(META_MODULE, "")) or module, raw=raw,
                         parameters=parameters, seeds=held)
            continue
        if node.target is operator.getitem and node.args[0] in root:  # an item of split's or unbind's views
            root[node] = root[node.args[0]]
            continue
        if _aliases_first(node.target) and node.args[0] in root:  # a view or an in-place op's result
            root[node] = root[node.args[0]]
        targets = [t for t in _written(node) if t in root]
        for target in targets:
            buffer = root[target]
            name = buffer if raw or not buffer.startswith(_PREFIX) else buffer[len(_PREFIX):]
            from_rows = any(varies(a) for a in node.all_input_nodes if a not in targets)
            if name not in out:
                out[name] = BufferWrite(buffer=name, module=str(node.meta.get(META_MODULE, "")) or module,
                                        source=source_line(node), parameter=buffer in parameters, from_rows=from_rows,
                                        op=str(node.target))
            elif from_rows and not out[name].from_rows:
                out[name] = dataclasses.replace(out[name], from_rows=True)


def buffer_write_problem(writes: list[BufferWrite], *, dp: int, microbatches: int, where: str = "",
                         shards_params: bool = False) -> str | None:
    """The refusal of a plan that cuts the batch (``dp`` ranks or ``microbatches``) for a model whose
    forward writes buffers; None when it keeps the batch whole or there are none, or when only dp
    cuts it and no written value depends on the batch (each rank then writes its copy once per step,
    as one process does, from the same values), unless ``shards_params`` (fsdp) and a parameter is
    written (into a gathered copy the reshard drops). ``where`` names what set the cut (default the
    plan field: ``mesh.dp``, else ``schedule.microbatches``)."""
    if not writes or (dp <= 1 and microbatches <= 1):
        return None
    rowless = not any(w.from_rows or w.trainable for w in writes)
    trained = [w.buffer for w in writes if w.trainable]
    if microbatches <= 1 and rowless and not (shards_params and any(w.parameter for w in writes)):
        return None
    shown = ", ".join(w.describe() for w in writes[:4]) + (f" and {len(writes) - 4} more" if len(writes) > 4 else "")
    if microbatches <= 1 and trained and not any(w.from_rows for w in writes):
        return (f"{where or 'mesh.dp'}: the model's forward writes the parameter(s) {', '.join(trained[:4])} in place "
                f"({shown}), which the optimizer also trains: data parallelism reduces their gradients in buckets of "
                "views, which a write in forward breaks (each rank would fail at its first step). Use "
                f"{KEEP_BATCH_WHOLE}, freeze them with requires_grad_(False) if the optimizer need not train them, or "
                "move the write into the training loop")
    where = where or ("schedule.microbatches" if microbatches > 1 and (rowless or dp <= 1) else
                      "data_parallel.kind" if rowless else "mesh.dp")
    cuts = " and ".join(c for c in (f"dp={dp} ranks" if dp > 1 else "", f"{microbatches} microbatches"
                                    if microbatches > 1 else "") if c)
    what = "buffer(s) or parameter(s)" if any(w.parameter for w in writes) else "buffer(s)"
    return (f"{where}: the model's forward writes the {what} {shown} in place, and a plan with {cuts} runs the "
            "forward on each slice of the batch: the update would run once per slice and microbatch, from that "
            "slice alone (each dp rank's copy its own), where one process runs it once per step on the whole "
            f"batch. Use {KEEP_BATCH_WHOLE} (pipeline and tensor parallelism keep the batch whole), or move the "
            "update out of forward into the training loop" + (
                "; no written value depends on the batch, so data parallelism with one microbatch and "
                "data_parallel.kind ddp, zero1 or zero2 also keeps it exact" if rowless else ""))


def writes_differ(small: torch.fx.GraphModule, large: torch.fx.GraphModule) -> bool:
    """Whether two captures of one model at different numbers of rows compute its writes otherwise.
    torch.export bakes the batch's shape in as numbers: ``self.seen += x.shape[0]`` is ``add_(seen, 8)``
    in the whole batch's capture and ``add_(seen, 4)`` in a dp2 rank's, a write no batch input feeds
    in either graph (``BufferWrite.from_rows`` False), which each rank would make from its slice's
    size. The ops that feed each write, with their constants, are compared."""
    return _write_slices(small) != _write_slices(large)


def _write_slices(gm: torch.fx.GraphModule) -> list[str]:
    """The ops feeding each write of ``gm`` (a higher-order op's body counted whole), in graph order, as text."""
    root = {n for n in gm.graph.nodes if n.op == "get_attr" and isinstance(_fetch(gm, str(n.target)), torch.Tensor)}
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not node.args:
            continue
        if (node.target is operator.getitem or _aliases_first(node.target)) and node.args[0] in root:
            root.add(node)
        hop = any(isinstance(_fetch(gm, str(a.target)), torch.fx.GraphModule) for a in node.all_input_nodes
                  if a.op == "get_attr")
        if hop or any(t in root for t in _written(node)):
            feeding, stack = set(), [node]
            while stack:
                n = stack.pop()
                if n not in feeding:
                    feeding.add(n)
                    stack.extend(n.all_input_nodes)
            out.append(_text(gm, feeding))
    return out


def _text(gm: torch.fx.GraphModule, nodes: set[torch.fx.Node] | None = None) -> str:
    index: dict[torch.fx.Node, str] = {}

    def arg(a: torch.fx.Node) -> str:
        body = _fetch(gm, str(a.target)) if a.op == "get_attr" else None
        return f"{{{_text(body)}}}" if isinstance(body, torch.fx.GraphModule) else index[a]

    lines = []
    for n in gm.graph.nodes:
        if nodes is None or n in nodes:
            index[n] = f"%{len(index)}"
            shown = torch.fx.node.map_arg((n.args, n.kwargs), arg)
            named = n.op not in ("placeholder", "get_attr") or not isinstance(_fetch(gm, str(n.target)), torch.fx.GraphModule)
            lines.append(f"{n.op} {n.target if named and n.op != 'placeholder' else ''} {shown}")
    return "; ".join(lines)


# In-place by schema, but they write no value: a model built on ``meta`` traces each tensor its
# forward makes (HF's empty KV cache, ``torch.tensor([])``) as a lifted constant then ``detach_``,
# where on the CPU it is ``lift_fresh_copy``; counting it made every HF decoder planned on meta
# lose data parallelism.
_NO_VALUE_WRITTEN = frozenset({"aten::detach_"})


def _written(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes whose tensors ``node``'s op writes in place: its first argument (``add_``), an
    ``out=`` argument (``torch.mean(x, 0, out=buf)``), each tensor of a list (``torch._foreach_lerp_``)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) \
            or target._schema.name in _NO_VALUE_WRITTEN:
        return []
    out: list[torch.fx.Node] = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.kwargs.get(arg.name) if arg.kwarg_only or i >= len(node.args) else node.args[i]
        out.extend(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.fx.Node))
    return out


def written_in_place(node: torch.fx.Node, among: set[torch.fx.Node]) -> bool:
    """Whether an op of ``among`` writes ``node``'s tensor in place, itself or through a view of it
    (``h[:, :4] += g``: a slice, then ``add_`` on it; ``h[:, 0] = 0``; a ``view`` then ``mul_``)."""
    seen, stack = {node}, [node]
    while stack:
        n = stack.pop()
        for user in n.users:
            if user not in among:
                continue
            if n in _written(user):
                return True
            if (user.target is operator.getitem or _aliases_first(user.target)) and user.args \
                    and user.args[0] is n and user not in seen:
                seen.add(user)
                stack.append(user)
    return False


def _aliases_first(target: object) -> bool:
    """Whether ``target``'s result is its first argument (``add_``) or a view of it (``slice``,
    ``select``, ``view``, ``detach``, ``t``; ``split``'s list of views), through which a write reaches the tensor."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.arguments or not target._schema.returns:
        return False
    first, ret = target._schema.arguments[0].alias_info, target._schema.returns[0].alias_info
    return first is not None and ret is not None and bool(first.before_set & ret.before_set)


def _fetch(gm: torch.fx.GraphModule, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj
