"""Which pipeline stages the per-stage passes treat alike: compile one, know them all.

A 1T GPT cut into 128 (virtual) stages holds 126 stages that differ only in names: the same ops on
the same shapes, the same tensor-parallel styles, recompute kinds and FSDP units. The per-stage
passes (``shard_tensor_parallel`` → ``shard_experts`` → ``insert_recompute`` →
``shard_data_parallel`` → ``verify``) are deterministic functions of what :func:`stage_key`
records, so a stage compiles exactly when the first stage with its key does. The plan-time
compile check (``fairscale.compile_check``) compiles one stage per class::

    program = split_stages_pass(gm, plan, graph=graph)
    for members in stage_classes(program, plan):
        compile_rank(graph, plan, stages=[members[0]], ..., program=program)

What the key holds, per node of the stage graph in order: its op and target, its arguments with
nodes written as positions, the shape and dtype of its value; for a call, the style of the first
tensor-parallel rule matching its module (the TP pass's own matching), the recompute kind of its
layer, the depths at which its module path matches the FSDP unit selector, and the ``fs_param``
key's rank among the stage's keys (DP buckets follow key order); for a get_attr, the tensor's shape,
dtype and ``requires_grad``, the position of its first alias in the stage (tied weights), and
whether the stage must keep it whole (``StagedProgram.shared_keys``). Names (module paths, layer
names, attribute names) are left out: they are what differs between equivalent stages and the
passes only match selectors against them, which the key records as results.

The claim is checked by ``tests/passes/test_stage_classes.py``: the members of a class compile to
graphs with the same op sequence.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx
from torch.fx import Node

from passes.insert_recompute import layers_to_recompute
from passes.program import StagedProgram
from passes.stage_blueprint import Blueprint
from planner.graph import META_LAYER, META_MODULE, META_PARAM
from planner.plan import Plan
from planner.selectors import Selector, parse_selector

__all__ = ["stage_classes", "stage_key", "blueprint_key"]


def stage_classes(program: StagedProgram, plan: Plan) -> list[list[int]]:
    """Stage indices grouped by :func:`stage_key`, each group in stage order, groups in order of
    their first stage. A stage is keyed by its blueprint while it has one (:func:`blueprint_key`),
    so classifying builds no stage graph."""
    rules = [(parse_selector(text), style) for text, style in plan.tensor_parallel.rules.items()]
    units = parse_selector(plan.data_parallel.units) if plan.data_parallel.units else None
    layers = [name for st in program.stages for name in st.layers]
    recompute = layers_to_recompute(plan, layers)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for st in program.stages:
        shared = set(program.shared_keys(st.index))
        if st.blueprint is not None:
            key = blueprint_key(st.blueprint, rules=rules, recompute=recompute, units=units, shared=shared)
        elif st.gm is None:
            raise ValueError(f"stage {st.index} of this program was released; classify a fresh split (split_program)")
        else:
            key = stage_key(st.gm, rules=rules, recompute=recompute, units=units, shared=shared)
        groups.setdefault(key, []).append(st.index)
    return list(groups.values())


def stage_key(gm: torch.fx.GraphModule, *, rules: list[tuple[Selector, str]], recompute: dict[str, str],
              units: Selector | None, shared: set[str]) -> tuple[Any, ...]:
    """Everything the per-stage passes read from ``gm`` and the plan, without names (module docstring)."""
    nodes = list(gm.graph.nodes)
    return _key(nodes, lambda n: n, lambda n: n.op, lambda n: _attr(gm, str(n.target)), gm,
                rules=rules, recompute=recompute, units=units, shared=shared)


def blueprint_key(bp: Blueprint, *, rules: list[tuple[Selector, str]], recompute: dict[str, str],
                  units: Selector | None, shared: set[str]) -> tuple[Any, ...]:
    """:func:`stage_key` of the stage graph ``bp`` describes, read off the graph it was split from
    without building it. The build is a function of what this key records (names
    aside), so two stages with one blueprint key build graphs with one :func:`stage_key`."""
    received = set(bp.recv)
    nodes = bp.nodes()
    key = _key(nodes, bp.ref, lambda n: "placeholder" if n in received else n.op, bp.values.__getitem__, bp.source,
               rules=rules, recompute=recompute, units=units, shared=shared)
    position = {n: i for i, n in enumerate(nodes)}
    return key + (("output", tuple(position[bp.ref(v)] for v in bp.send)), tuple(i for i, _ in bp.batch))


def _key(nodes: list[Node], ref: Callable[[Node], Node], op_of: Callable[[Node], str], attr: Callable[[Node], Any],
         gm: torch.fx.GraphModule, *, rules: list[tuple[Selector, str]], recompute: dict[str, str],
         units: Selector | None, shared: set[str]) -> tuple[Any, ...]:
    position: dict[Node, int] = {}
    first_alias: dict[int, int] = {}
    keys = sorted({str(n.meta[META_PARAM]) for n in nodes if META_PARAM in n.meta})
    key_rank = {k: i for i, k in enumerate(keys)}
    out: list[tuple[Any, ...]] = []
    for i, node in enumerate(nodes):
        position[node] = i
        op = op_of(node)
        placeholder = op == "placeholder"  # a received value: what it was computed from is not in the stage
        args = () if placeholder else _shape_of_args(node.args, position, ref)
        kwargs = () if placeholder else _shape_of_args(dict(node.kwargs), position, ref)
        param = node.meta.get(META_PARAM)
        item: tuple[Any, ...] = (op, args, kwargs, _value(node.meta.get("val")),
                                 key_rank.get(str(param), -1) if param is not None else -1)
        if op == "get_attr":
            t = attr(node)
            alias = first_alias.setdefault(id(t), i)
            item += (_value(t), bool(getattr(t, "requires_grad", False)), isinstance(t, torch.nn.Parameter), alias,
                     str(param) in shared if param is not None else False)
        elif op in ("call_function", "call_module", "call_method"):  # what a rule or recompute may touch
            module = str(node.meta.get(META_MODULE, "") or "")
            style = next((s for sel, s in rules if module and sel.matches(module)), None)
            item += (_target(gm, node), style, recompute.get(str(node.meta.get(META_LAYER, ""))),
                     _unit_depths(module, units))
        out.append(item)
    return tuple(out)


def _target(gm: torch.fx.GraphModule, node: Node) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__qualname__
    return str(node.target)


def _shape_of_args(a: Any, position: dict[Node, int], ref: Callable[[Node], Node]) -> Any:
    if isinstance(a, Node):
        return ("node", position[ref(a)])
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_shape_of_args(x, position, ref) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _shape_of_args(v, position, ref)) for k, v in a.items()))
    return repr(a)


def _value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):  # a size from the data (MoE routing's nonzero) is a SymInt: its name
        return (tuple(d if isinstance(d, int) else str(d) for d in v.shape), str(v.dtype))
    if isinstance(v, (list, tuple)):
        return tuple(_value(x) for x in v)
    return None if v is None else type(v).__name__


def _unit_depths(module: str, units: Selector | None) -> tuple[int, ...]:
    if units is None or not module:
        return ()
    parts = module.split(".")
    return tuple(d for d in range(1, len(parts) + 1) if units.matches(".".join(parts[:d])))


def _attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
