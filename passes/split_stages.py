"""Cut a captured graph into pipeline stages: one ordinary GraphModule per (virtual) stage.

The plan lists the stages in order, each a selector of layers (``planner.selectors``)::

    "stages": [{"layers": "wte, wpe, layers.[0-1]"}, {"layers": "layers.[2-3], ln_f, lm_head"}]

Every compute node goes to the stage of its layer (``fs_layer``). Then, per stage:

* **Parameters and buffers** are copied into every stage that reads them, under the same
  attribute path, with their ``fs_param`` meta; ``gm.meta["fs_layout"]`` records their user keys.
  A parameter read by several stages (GPT's tied ``wte``/``lm_head``) is a copy on each; the
  runtime sums the copies' gradients so they stay identical (:attr:`StagedProgram.shared`).
* **Batch inputs** (token ids, labels) are placeholders of every stage that reads them: each
  pipeline rank loads the same microbatch, as Megatron-LM's first and last stages do, instead of
  sending labels down the pipeline.
* **Values that need no gradient and come only from batch inputs and buffers** (attention masks,
  rotary tables, position ids) are recomputed by each stage that uses them rather than sent:
  their cone of nodes is copied in (no random ops allowed in it).
* **Every other value that crosses a cut** is sent to the next stage, and relayed through the
  stages in between when it skips some (a skip connection from stage 0 to stage 3 passes through
  stages 1 and 2 as an extra output), so a stage only talks to its neighbours. A tuple-valued
  node's ``getitem`` users move to the tuple's stage, so only tensors cross.

A stage's GraphModule is called as ``stage.gm(*batch_inputs, *received)`` and returns the tuple it
sends (the last stage returns ``(loss,)``). Picture for GPT with 2 stages::

    stage 0: (batch_0, ) -> (add_3, )          holds wte(=lm_head), wpe, layers.0-1
    stage 1: (batch_1, add_3) -> (loss, )      holds layers.2-3, ln_f, lm_head(=wte)

node.meta read: ``fs_layer`` (capture), ``fs_param``, ``val``. Written (on the input graph and the
stage graphs): ``fs_stage`` = owning stage of each compute node; ``fs_stages`` = every stage that
holds a copy (placeholders, get_attr, recomputed nodes). gm.meta written on each stage graph:
``fs_layout`` and ``fs_stage_io`` (:class:`StageIO`: which placeholders are received values and
whether the outputs are sent, which lets later passes such as the tensor-parallel one choose how
boundary values travel).
"""

from __future__ import annotations

import copy
import functools
import itertools
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from passes.tp.functionalize import is_inplace
from passes.layout import META_LAYOUT, ParamLayout
from passes.program import StagedProgram, StageGraph, ValueSpec
from passes.stage_blueprint import Blueprint, blueprint
from planner.buffer_writes import written_in_place
from planner.fx_module import graph_module
from planner.graph import META_LAYER, META_MODULE, META_PARAM, ModelGraph, impure
from planner.modpath import fetch_attr, install_attr
from planner.plan import Plan, PlanError
from planner.selectors import parse_selector, stage_layers

__all__ = ["split_stages_pass", "StagedProgram", "StageGraph", "StageIO", "ValueSpec", "resolve_stages",
           "META_STAGE", "META_STAGES", "META_IO", "SplitError", "stage_io"]

META_STAGE = "fs_stage"
"""int: the stage that owns (computes) the node."""
META_STAGES = "fs_stages"
"""list[int]: every stage holding a copy of the node (batch placeholders, parameters, recomputed values)."""

META_IO = "fs_stage_io"
"""gm.meta key of a stage graph: its :class:`StageIO`."""

_RANDOM = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial")


class SplitError(ValueError):
    """The graph cannot be cut as the plan asks; the message quotes the node and says what to do."""


@dataclass(frozen=True, kw_only=True)
class StageIO:
    """What a stage graph's placeholders and outputs are (``gm.meta["fs_stage_io"]``)."""

    received: tuple[str, ...]
    """Targets of the placeholders that receive values from the previous stage (the others are
    batch inputs, which every pipeline rank loads whole)."""
    sends: bool
    """Whether the outputs are sent to the next stage (False on the last stage: it returns the loss)."""


def stage_io(gm: torch.nn.Module) -> StageIO | None:
    """The :class:`StageIO` of a stage graph :func:`split_stages_pass` built; None for any other graph."""
    meta = getattr(gm, "meta", None)
    io = meta.get(META_IO) if isinstance(meta, dict) else None
    return io if isinstance(io, StageIO) else None


def resolve_stages(plan: Plan, graph: ModelGraph) -> list[list[str]]:
    """Layer names of each plan stage; raise PlanError listing every problem."""
    names = [layer.name for layer in graph.layers]
    want = plan.mesh.pp * plan.schedule.virtual_stages
    if not plan.stages:
        if want == 1:
            return [names]
        raise PlanError([f"stages: empty, but pp ({plan.mesh.pp}) × virtual_stages "
                         f"({plan.schedule.virtual_stages}) = {want} stages are needed"])
    problems = []
    if len(plan.stages) != want:
        problems.append(f"stages: {len(plan.stages)} given, but pp ({plan.mesh.pp}) × virtual_stages "
                        f"({plan.schedule.virtual_stages}) = {want}")
    owner: dict[str, int] = {}
    chosen: list[list[str]] = []
    selectors = [parse_selector(stage.layers) for stage in plan.stages]
    for i, picked in enumerate(stage_layers(selectors, names)):
        for pat in selectors[i].unmatched(names):
            problems.append(f"stages[{i}].layers: {pat!r} matches no layer")
        for name in picked:
            if name in owner:
                problems.append(f"stages[{i}].layers: {name} is already in stages[{owner[name]}]")
            else:
                owner[name] = i
        chosen.append(picked)
    left = [n for n in names if n not in owner]
    if left:
        problems.append(f"stages: layers {', '.join(left)} are in no stage")
    if not problems:
        index = {n: j for j, n in enumerate(names)}
        for i in range(1, len(chosen)):
            if chosen[i - 1] and chosen[i] and index[chosen[i][0]] < index[chosen[i - 1][-1]]:
                problems.append(f"stages[{i}].layers: {chosen[i][0]} runs before {chosen[i - 1][-1]} of "
                                f"stages[{i - 1}]; stages must be contiguous runs of layers in execution order")
            if not chosen[i]:
                problems.append(f"stages[{i}].layers: holds no layer")
    if problems:
        raise PlanError(problems, source="plan")
    return chosen


def split_stages_pass(gm: torch.fx.GraphModule, plan: Plan, *, graph: ModelGraph,
                      share_weights: bool = False) -> StagedProgram:
    """Cut ``gm`` (the captured loss graph) into ``pp × virtual_stages`` stage GraphModules, each
    built when its ``gm`` is first read (``passes.stage_blueprint``; built at once when the stages
    copy real weights, so that they copy them as they are now).

    Usage::

        program = split_stages_pass(graph.gm, plan, graph=graph)
        out = program.stages[0].gm(ids)          # -> values for stage 1

    Args:
        gm: the captured graph (``graph.gm`` or a clone), taking the flat batch, returning the loss.
        plan: its ``stages`` (selectors), ``mesh.pp`` and ``schedule.virtual_stages`` are read.
        graph: the :class:`ModelGraph` ``gm`` came from (layers, tied parameters).
        share_weights: the stage graphs hold ``gm``'s own parameter and buffer tensors instead of
            copies: no memory, for a caller whose later passes copy what the rank keeps
            (``passes.compile_rank``). Trained as they are, such stages would write into ``gm``.
    """
    layer_stage = {name: i for i, names in enumerate(resolve_stages(plan, graph)) for name in names}
    n = max(layer_stage.values(), default=0) + 1
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    owner = _assign_owners(gm, nodes, layer_stage, n)
    pure = _pure_nodes(gm, nodes)
    writes = _mutators(nodes)
    out_node = next(node for node in nodes if node.op == "output")
    loss = out_node.args[0]
    if isinstance(loss, (tuple, list)):
        if len(loss) != 1:
            raise SplitError(f"the captured graph must return one loss, got {out_node.format_node()}")
        loss = loss[0]
    if not isinstance(loss, torch.fx.Node) or owner.get(loss, -1) != n - 1:
        raise SplitError(f"the loss ({out_node.format_node()}) must be computed on the last stage ({n - 1}); "
                         "put the layers that compute it in the plan's last stage")

    # Which values each stage needs: computed locally, recomputed (pure cone), or received.
    local: list[set[torch.fx.Node]] = [set() for _ in range(n)]
    sent_until: dict[torch.fx.Node, int] = {}  # value -> last stage that consumes it as a received value
    for node in nodes:
        if node in owner:
            local[owner[node]].add(node)
    for node in nodes:
        if node not in owner:
            continue
        s = owner[node]
        for inp in node.all_input_nodes:
            if inp.op != "call_function" or owner[inp] == s:
                continue
            if owner[inp] > s:
                raise SplitError(f"{node.format_node()} on stage {s} reads {inp.name} computed on later stage "
                                 f"{owner[inp]}; move the cut so data flows forward")
            if pure[inp]:
                _add_cone(inp, local[s], pure, writes)
            else:
                sent_until[inp] = max(sent_until.get(inp, -1), s)
    # a recomputed cone may itself read values that are sent (never: a pure cone reads only pure nodes)
    boundaries: list[list[torch.fx.Node]] = []
    for s in range(n - 1):
        crossing = [v for v in sent_until if owner[v] <= s < sent_until[v]]
        boundaries.append(sorted(crossing, key=position.__getitem__))
    for values in boundaries:
        for v in values:
            _check_sendable(v, owner[v])

    aliases: dict[str, list[str]] = {}
    for group in graph.tied:
        for key in group:
            aliases[key] = list(group)
    placeholders = [node for node in nodes if node.op == "placeholder"]
    buffers = {name for name, _ in gm.named_buffers()}
    stages: list[StageGraph] = []
    holders: dict[str, list[int]] = {}
    plans: list[Blueprint] = []
    for s in range(n):
        recv = boundaries[s - 1] if s > 0 else []
        send = boundaries[s] if s < n - 1 else [loss]
        bp = blueprint(gm, local[s], recv, send, placeholders, position)
        build = functools.partial(_build_stage, s, bp, pure, buffers, sends=s < n - 1, share=share_weights)
        stages.append(StageGraph(index=s, builder=build, blueprint=bp, keys=_param_keys(bp),
                                 layers=[name for name, i in layer_stage.items() if i == s],
                                 batch_inputs=[idx for idx, _ in bp.batch],
                                 batch_specs=[_spec(ph, pure) for _, ph in bp.batch],
                                 inputs=[_spec(v, pure) for v in bp.recv], outputs=[_spec(v, pure) for v in bp.send]))
        for key in {aliases.get(k, [k])[0] for k in _trainable_keys(bp)}:
            holders.setdefault(key, []).append(s)
        plans.append(bp)
    # Built when first used: with the capture's own tensors (share_weights) or on meta, a later build
    # is the same build; a copy of real weights is taken now, as they are now.
    if not share_weights and not all(t.is_meta for t in itertools.chain(gm.parameters(), gm.buffers())):
        for st in stages:
            st.build()
    _annotate(nodes, owner, plans, local)
    shared = {k: v for k, v in holders.items() if len(v) > 1}
    microbatch = stages[0].batch_specs[0].shape[0] if stages[0].batch_specs and stages[0].batch_specs[0].shape else 1
    return StagedProgram(stages=stages, shared=shared, aliases=aliases, microbatch=microbatch)


def _assign_owners(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], layer_stage: dict[str, int],
                   n: int) -> dict[torch.fx.Node, int]:
    owner: dict[torch.fx.Node, int] = {}
    for node in nodes:
        if node.op != "call_function":
            continue
        layer = node.meta.get(META_LAYER)
        if layer in layer_stage:
            owner[node] = layer_stage[layer]
        else:  # no layer recorded: run it as early as its inputs allow
            owner[node] = max((owner.get(i, 0) for i in node.all_input_nodes), default=0)
    # getitem of a tuple-valued node runs where the tuple is, so only tensors cross a cut
    for node in nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            if isinstance(src, torch.fx.Node) and src in owner:
                owner[node] = owner[src]
    return owner


def _is_view(target: Any) -> bool:
    """Whether ``target`` is an ATen overload whose output aliases its first input without writing it."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns or not schema.arguments:
        return False
    out, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return out is not None and not out.is_write and first is not None and not first.is_write


def _mutators(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """value -> the in-place ops that write it, directly or through views of it (Hugging Face's
    ``shift_tokens_right``: ``new_zeros``, then ``copy_`` into a slice of it and ``fill_`` of a
    column, then ``masked_fill_``). A stage that recomputes the value must replay them too."""
    out: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in nodes:
        if node.op != "call_function" or not is_inplace(node.target) or not node.args:
            continue
        base = node.args[0]
        while isinstance(base, torch.fx.Node):
            out.setdefault(base, []).append(node)
            if not (base.op == "call_function" and _is_view(base.target) and base.args):
                break
            base = base.args[0]
    return out


def _pure_nodes(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, bool]:
    """Nodes computed only from batch inputs, buffers and constants, with no random op; a value
    an in-place op writes is pure only if that op is (:func:`_mutators`)."""
    params = {id(p) for p in gm.parameters()}
    writes = _mutators(nodes)
    pure: dict[torch.fx.Node, bool] = {}
    for _ in range(2):  # the second pass sees the writes that come after the values they write
        for node in nodes:
            if node.op == "placeholder":
                pure[node] = True
            elif node.op == "get_attr":
                pure[node] = id(fetch_attr(gm, str(node.target))) not in params
            elif node.op == "call_function":
                name = str(node.target).lower()
                pure[node] = (not any(r in name for r in _RANDOM)
                              and all(pure.get(i, False) for i in node.all_input_nodes)
                              and all(pure.get(w, True) for w in writes.get(node, [])))
            else:
                pure[node] = False
    return pure


def _add_cone(node: torch.fx.Node, into: set[torch.fx.Node], pure: dict[torch.fx.Node, bool],
              writes: dict[torch.fx.Node, list[torch.fx.Node]]) -> None:
    """``node`` and what it is computed from, to recompute on a stage: with every in-place op
    that writes any of them (an op in place on a slice of a fresh tensor changes the tensor)."""
    stack = [node]
    while stack:
        cur = stack.pop()
        if cur in into or cur.op != "call_function":
            continue
        into.add(cur)
        stack.extend(cur.all_input_nodes)
        stack.extend(writes.get(cur, []))


def _check_sendable(v: torch.fx.Node, stage: int) -> None:
    val = v.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise SplitError(f"{v.format_node()} crosses the cut after stage {stage} but its value is a "
                         f"{type(val).__name__}, not a tensor; move the cut so it stays inside one stage")


def _spec(node: torch.fx.Node, pure: dict[torch.fx.Node, bool]) -> ValueSpec:
    val = node.meta["val"]
    return ValueSpec(name=node.name, shape=tuple(int(d) for d in val.shape), dtype=val.dtype,
                     grad=bool(val.dtype.is_floating_point and not pure.get(node, False)))


def _stage_value(value: Any, *, share: bool) -> Any:
    """What a stage graph holds for one of the capture's attributes: the tensor itself when ``share``
    (``passes.compile_rank``, whose data-parallel pass copies every tensor the rank keeps), else a
    copy, so a stage graph trained as it is never writes into the user's model. Modules and other
    objects are always copied."""
    if isinstance(value, nn.Parameter):
        return value if share else nn.Parameter(value.detach().clone(), requires_grad=value.requires_grad)
    if isinstance(value, torch.Tensor):
        return value if share else value.detach().clone()
    return copy.deepcopy(value)


def _build_stage(s: int, bp: Blueprint, pure: dict[torch.fx.Node, bool],
                 buffers: set[str], *, sends: bool, share: bool) -> torch.fx.GraphModule:
    """The GraphModule of stage ``s``: a copy of ``bp``'s nodes (``passes.stage_blueprint``)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for _, ph in bp.batch:
        env[ph] = graph.node_copy(ph, lambda x: env[x])
    received: list[str] = []
    for v in bp.recv:
        new = graph.placeholder(v.name)
        new.meta = copy.copy(v.meta)
        env[v] = new
        received.append(str(new.target))  # the placeholder's, also where a clone stands for it below
    body = set(bp.body)
    for v in bp.recv:  # a received activation is a leaf here: autograd refuses in-place ops on it and its views
        if written_in_place(v, body):
            copied = graph.call_function(torch.ops.aten.clone.default, (env[v],))
            copied.meta = copy.copy(v.meta)
            user = next(u for u in bp.body if u in v.users)  # the copy is this stage's, not the sender's module
            for key in (META_MODULE, META_LAYER, "nn_module_stack"):  # (tp rules name modules)
                if key in user.meta:
                    copied.meta[key] = user.meta[key]
                else:
                    copied.meta.pop(key, None)
            env[v] = copied
    root = nn.Module()
    for node in bp.attrs:
        target = str(node.target)
        install_attr(root, target, _stage_value(bp.values[node], share=share), buffer=target in buffers)
        env[node] = graph.node_copy(node, lambda x: env[x])
    for node, kept in bp.alias.items():
        if kept is not node and kept in env:  # two attribute names, one tensor: one copy
            env[node] = env[kept]
    for node in bp.body:
        env[node] = graph.node_copy(node, lambda x: env[x])
        env[node].meta[META_STAGE] = s
    graph.output(tuple(env[v] for v in bp.send))
    if graph.eliminate_dead_code(is_impure_node=lambda n: impure(n, root)):  # the blueprint left the dead code out already
        raise AssertionError(f"stage {s}: the blueprint kept nodes the graph's dead-code elimination removes "
                             "(passes.stage_blueprint and torch.fx disagree); please report this")
    stage_gm = graph_module(root, graph, class_name=f"Stage{s}")
    stage_gm.meta[META_LAYOUT] = ParamLayout(keys=_param_keys(bp))
    stage_gm.meta[META_IO] = StageIO(received=tuple(received), sends=sends)
    return stage_gm


def _param_keys(bp: Blueprint) -> dict[str, str]:
    """attr -> user state_dict key of the tensors the stage holds (``gm.meta["fs_layout"]``)."""
    return {str(n.target): n.meta[META_PARAM] for n in bp.attrs
            if META_PARAM in n.meta and isinstance(bp.values[n], torch.Tensor)}


def _trainable_keys(bp: Blueprint) -> list[str]:
    """User keys of the trainable parameters the stage holds."""
    return [n.meta[META_PARAM] for n in bp.attrs if META_PARAM in n.meta
            and isinstance(p := bp.values[n], nn.Parameter) and p.requires_grad]


def _annotate(nodes: list[torch.fx.Node], owner: dict[torch.fx.Node, int], plans: list[Blueprint],
              local: list[set[torch.fx.Node]]) -> None:
    holders: dict[torch.fx.Node, list[int]] = {}  # placeholder or get_attr -> stages whose graph holds it
    for s, bp in enumerate(plans):
        for node in [ph for _, ph in bp.batch] + bp.attrs:
            holders.setdefault(node, []).append(s)
    kept: dict[torch.fx.Node, list[int]] = {}
    for s, keep in enumerate(local):
        for node in keep:
            kept.setdefault(node, []).append(s)
    for node in nodes:
        if node in owner:
            node.meta[META_STAGE] = owner[node]
        copies = kept.get(node, [])
        if node.op in ("placeholder", "get_attr"):
            copies = holders.get(node, [])
        if copies:
            node.meta[META_STAGES] = copies
