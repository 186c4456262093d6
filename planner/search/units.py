"""FSDP units as the cost model sees them: which parameters are gathered together.

The rule is the FSDP pass's own (``passes.dp.fsdp.assign_units``): every module path that
``data_parallel.units`` selects is a unit, a parameter belongs to the innermost selected module
holding it, and the rest form the root unit. The default (no selector) makes each repeated block
a unit. Units may sit below the block (``layers.*.attn, layers.*.mlp``): a smaller largest unit
means smaller unshard buffers, which is what lets ZeRO-3 of very large models fit.

Units: parameter elements (before the tensor-parallel split; :func:`rank_units` applies it).
"""

from __future__ import annotations

from planner.cost import LayerCost
from planner.graph import ModelGraph
from planner.plan import PlanError
from planner.selectors import parse_selector

__all__ = ["UnitTable", "unit_table", "rank_units", "sub_block_units"]

UnitTable = list[dict[str, float]]
"""Per layer index: unit name -> parameter elements of that unit first used by the layer
(``""`` is the root unit)."""


def unit_table(graph: ModelGraph | None, facts_names: list[str], facts_blocks: list[str | None],
               facts_params: list[int], text: str | None) -> UnitTable:
    """The unit table for selector ``text`` (None: every repeated-block layer is a unit).

    Raises PlanError when ``text`` selects no module holding parameters: an empty selection would
    silently make the whole model one root unit."""
    if not text:
        return [({name: float(p)} if block else {"": float(p)})
                for name, block, p in zip(facts_names, facts_blocks, facts_params)]
    sel = parse_selector(text)
    if graph is None or not graph.param_shapes:  # analytic facts without modules: units are layers
        table = [({name: float(p)} if sel.matches(name) else {"": float(p)})
                 for name, p in zip(facts_names, facts_params)]
        if all(set(row) == {""} for row in table):
            raise PlanError([f'data_parallel.units: "{text}" matches no layer; layers are e.g. '
                             f'{", ".join(facts_names[:4])}'], source="constraints")
        return table
    alias: dict[str, str] = {}
    for group in graph.tied:
        canon = next((k for k in group if k in graph.param_shapes), group[0])
        alias.update({k: canon for k in group})
    owner: dict[str, str] = {}
    for key in graph.param_shapes:
        parts = key.split(".")
        owner[key] = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)
                           if sel.matches(".".join(parts[:i]))), "")
    if all(v == "" for v in owner.values()):
        mods = [m for m in graph.modules if m]
        raise PlanError([f'data_parallel.units: "{text}" selects no module holding parameters, so the whole '
                         f'model would be one root unit; modules are e.g. {", ".join(mods[:6])}'], source="constraints")
    index = {name: i for i, name in enumerate(facts_names)}
    out: UnitTable = [{} for _ in facts_names]
    seen: set[str] = set()
    for layer in graph.layers:
        i = index.get(layer.name)
        if i is None:
            continue
        for key in layer.params:
            key = alias.get(key, key)
            if key in seen or key not in graph.param_shapes:
                continue
            seen.add(key)
            n = 1
            for d in graph.param_shapes[key]:
                n *= d
            row = out[i]
            row[owner[key]] = row.get(owner[key], 0.0) + n
    return out


def rank_units(table: UnitTable, facts_params: list[int], costs: list[LayerCost], layers: list[int]) -> list[float]:
    """Unit sizes (elements after the tensor-parallel split) on a rank holding ``layers``: each
    named unit summed over the rank's layers, and the root unit last (if it holds anything)."""
    named, root = rank_unit_parts(table, facts_params, costs, layers)
    return named + ([root] if root > 0 else [])


def rank_unit_parts(table: UnitTable, facts_params: list[int], costs: list[LayerCost],
                    layers: list[int]) -> tuple[list[float], float]:
    """(the named units' sizes, the root unit's) of :func:`rank_units`."""
    named: dict[str, float] = {}
    root = 0.0
    for i in layers:
        scale = costs[i].params / facts_params[i] if facts_params[i] else 0.0
        for name, n in table[i].items():
            if name:
                named[name] = named.get(name, 0.0) + n * scale
            else:
                root += n * scale
    return list(named.values()), root


def sub_block_units(graph: ModelGraph | None, block_layers: dict[str, list[str]], *,
                    share: float = 0.1) -> str | None:
    """A selector one level below the repeated blocks: their direct children holding at least
    ``share`` of the block's parameters (attention and MLP of a transformer block), e.g.
    ``layers.*.attn, layers.*.mlp``. None when there is no such split (no graph, no block, or a
    block whose parameters sit in one child)."""
    if graph is None or not graph.param_shapes:
        return None
    picks: list[str] = []
    for pattern, members in sorted(block_layers.items()):
        if not members:
            continue
        first = members[0] + "."
        sizes: dict[str, int] = {}
        for key, shape in graph.param_shapes.items():
            if key.startswith(first):
                child = key[len(first):].split(".")[0]
                n = 1
                for d in shape:
                    n *= d
                sizes[child] = sizes.get(child, 0) + n
        total = sum(sizes.values())
        big = [c for c, n in sizes.items() if total and n >= share * total and f"{members[0]}.{c}" in graph.modules]
        if len(big) >= 2:
            picks.extend(f"{pattern}.{c}" for c in sorted(big))
    return ", ".join(picks) or None
