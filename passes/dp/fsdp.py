"""The FSDP (ZeRO-3) rewrite behind ``shard_data_parallel_pass`` for ``kind="fsdp"``.

Units: every module path selected by ``data_parallel.units`` is a unit; a parameter belongs to the
innermost selected module that contains it, and the rest form the root unit. Each unit becomes one
:class:`passes.layout.FlatShard`: members flattened in order of first use, zero-padded to a
multiple of ``n``; this rank keeps elements ``[i·padded/n, (i+1)·padded/n)`` as an fp32 parameter.

Per unit ``u`` the graph gets (worked picture for two block units and a root)::

    root = fsdp_unshard(self.fsdp_unit_0, self.fsdp_unit_0.flat)    # wte, wpe, ln_f ...
    b0   = fsdp_unshard(self.fsdp_unit_1, ...)    # forward prefetches unit 2 here
    ... block 0 ...
    h    = fsdp_reshard(self.fsdp_unit_1, h)      # frees unit 1; backward re-gathers it
    b1   = fsdp_unshard(self.fsdp_unit_2, ...)
    ... block 1 ...
    h    = fsdp_reshard(self.fsdp_unit_2, h)
    ... ln_f, lm_head (root stays gathered: it is needed first in backward)

The reshard point of a unit is right after the last node reading any of its parameters or a view
of them; every floating-point value live across that point that depends on the batch or on the
unit passes through ``fsdp_reshard``, so autograd runs its backward (the re-gather) before any
backward op of the unit, and the unit's own backward ends in ``fsdp_unshard``'s backward
(reduce-scatter, then free). The root unit is not resharded after forward (as PyTorch FSDP2).
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Collection

import torch
import torch.fx

from passes.dp.buckets import insert_buckets, split_experts, split_replicated
from passes.dp.graph import (ParamUse, cast_io, common_dtype, drop_aliases, find_params, fresh_layout, fill_shard,
                             is_alias_op, keep_frozen, positions, rebuild, replace_param_uses)
from passes.dp.info import META_DP, DataParallelInfo, ExpertGroup, Placement
from passes.layout import FlatShard
from passes.ops import dp_ops
from passes.ops.dp_ops import FSDPUnit
from planner.plan import DataParallel

__all__ = ["rewrite_fsdp", "assign_units"]


def assign_units(keys: list[str], selector: str, *, model_keys: Collection[str] | None = None) -> dict[str, str]:
    """user key -> unit name (a selected module path, or ``""`` for the root unit).

    The selector is checked against the whole model, ``model_keys`` (default ``keys``): a pipeline
    stage where it selects no module is all root unit, as the plan docs say of the modules the
    selector misses (and as the planner counts units, ``planner.search.units``); only a selector
    that selects nothing anywhere is refused, since the whole model would then be one unit."""
    if not selector.strip():
        return {k: "" for k in keys}
    from planner.selectors import parse_selector

    sel = parse_selector(selector)
    out = {key: _owner(key, sel) for key in keys}
    everywhere = list(keys) if model_keys is None else list(model_keys)
    if not any(out.values()) and not any(_owner(key, sel) for key in model_keys or ()):
        raise ValueError(f"data_parallel.units = {selector!r} selects no module holding parameters in the model, "
                         f"so it would be one root unit; parameters are e.g. {everywhere[:4]}: select the "
                         f"repeated blocks (e.g. \"layers.*\"), or leave units empty for one unit on purpose")
    return out


def _owner(key: str, sel: Any) -> str:
    """The innermost module selected by ``sel`` that holds parameter ``key``; "" for none."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if sel.matches(prefix):
            return prefix
    return ""


def rewrite_fsdp(gm: torch.fx.GraphModule, cfg: DataParallel, *, dp_index: int, dp_size: int, axis: str,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                 place: Placement, replicate: Collection[str] = (),
                 experts: ExpertGroup | None = None, model_keys: Collection[str] | None = None) -> torch.fx.GraphModule:
    """``model_keys``: every parameter key of the model ``gm`` is a stage of (default: ``gm``'s own),
    what ``data_parallel.units`` is checked against (:func:`assign_units`)."""
    layout = fresh_layout(gm)
    graph = copy.deepcopy(gm.graph)
    params = find_params(gm, graph, layout)
    info = DataParallelInfo(kind="fsdp", axis=axis, dp_index=dp_index, dp_size=dp_size, config=cfg,
                            aliases=drop_aliases(params, layout))
    objects: dict[str, object] = {}
    trainable = keep_frozen(graph, params, info, objects, param_dtype=param_dtype, place=place)
    for attr, key in info.replicated.items():
        layout.keys[attr] = key
    if experts is not None:
        own, trainable = split_experts(graph, trainable, layout, experts)
        if own:  # expert-parallel weights are this rank's own already: averaged, never flattened
            insert_buckets(graph, info, objects, own, kind="ddp", bucket_mb=cfg.bucket_mb, param_dtype=param_dtype,
                           reduce_dtype=reduce_dtype, group=experts, place=place)
            for u in own:
                layout.keys[u.attr] = u.key
    plain, trainable = split_replicated(trainable, set(replicate))
    if plain:
        insert_buckets(graph, info, objects, plain, kind="ddp", bucket_mb=cfg.bucket_mb, param_dtype=param_dtype,
                       reduce_dtype=reduce_dtype, place=place)
        for u in plain:
            layout.keys[u.attr] = u.key
    owner = assign_units([u.key for u in trainable], cfg.units, model_keys=model_keys)
    groups: dict[str, list[ParamUse]] = {}
    for use in trainable:  # in order of first use, so units come out in forward order
        groups.setdefault(owner[use.key], []).append(use)
    pos = positions(graph)
    member_nodes: dict[int, list[torch.fx.Node]] = {}
    for i, (name, members) in enumerate(groups.items()):
        shapes = [u.tensor.shape for u in members]
        numel = sum(s.numel() for s in shapes)
        padded = -(-numel // dp_size) * dp_size
        per = padded // dp_size
        master = common_dtype([u.tensor for u in members], f"FSDP unit {name or '<root>'!r}")
        flat = place.store_zeros(per, master)  # this rank's shard only, built where it lives
        if not any(u.tensor.is_meta for u in members):  # meta: filled by materialize_sharded
            fill_shard(flat, [u.tensor.detach() for u in members], dp_index * per)
        reshard = cfg.reshard_after_forward and name != ""
        unit = FSDPUnit(index=i, name=name, keys=[u.key for u in members], shapes=list(shapes), n=dp_size,
                        rank=dp_index, axis=axis, param_dtype=param_dtype or master,
                        reduce_dtype=reduce_dtype or master, flat=flat,
                        reshard=reshard, prefetch=cfg.prefetch, offload=cfg.offload, compute_device=place.compute,
                        async_reduce=True)
        handle = f"fsdp_unit_{i}"
        objects[handle] = unit
        info.units.append(unit)
        for u in members:
            layout.keys.pop(u.attr, None)
        layout.flat[f"{handle}.flat"] = FlatShard(members=[(u.key, tuple(u.tensor.shape)) for u in members],
                                                  numel=numel, padded=padded, index=dp_index, count=dp_size,
                                                  axis=axis)
        first = min((user for u in members for n in u.nodes for user in n.users), key=lambda x: pos[x])
        with graph.inserting_before(first):
            h = graph.get_attr(handle)
            f = graph.get_attr(f"{handle}.flat")
            call = graph.call_function(dp_ops.fsdp_unshard, (h, f))
            outs = [graph.call_function(operator.getitem, (call, j)) for j in range(len(members))]
        for u, out in zip(members, outs):
            replace_param_uses(graph, u, out, keep={call})
        member_nodes[i] = outs
    for prev, nxt in zip(info.units, info.units[1:]):
        prev.next_fwd = nxt
    resharding = [u for u in info.units if u.reshard]
    for earlier, later in zip(resharding, resharding[1:]):
        later.prev_bwd = earlier
    for unit in resharding:
        if not _insert_reshard(graph, unit, member_nodes[unit.index]):
            unit.reshard = False  # its last use is the graph's last computation: nothing to free early
            if unit.prev_bwd is not None or any(u.prev_bwd is unit for u in resharding):
                _unlink(resharding, unit)
    if param_dtype is not None:
        cast_io(graph, param_dtype, gm)
    result = rebuild(gm, graph, objects, layout)
    result.meta[META_DP] = info
    return result


def _unlink(resharding: list[FSDPUnit], unit: FSDPUnit) -> None:
    for other in resharding:
        if other.prev_bwd is unit:
            other.prev_bwd = unit.prev_bwd
    unit.prev_bwd = None


def _insert_reshard(graph: torch.fx.Graph, unit: FSDPUnit, views: list[torch.fx.Node]) -> bool:
    """Insert ``fsdp_reshard`` after the unit's last use; False if nothing runs after it."""
    pos = positions(graph)
    aliases: set[torch.fx.Node] = set(views)
    for node in graph.nodes:  # graph order is topological, so one sweep closes the alias set
        if node not in aliases and is_alias_op(node, aliases):
            aliases.add(node)
    readers = [u for a in aliases for u in a.users] + list(aliases)
    end = max(readers, key=lambda n: pos[n])
    # a multi-output node (native_layer_norm) is read through getitems: the cut goes after them
    changed = True
    while changed:
        changed = False
        for node in graph.nodes:
            if pos[node] > pos[end]:
                break
            if isinstance(node.meta.get("val"), torch.Tensor):
                continue
            for user in node.users:
                if user.target is operator.getitem and pos[user] > pos[end]:
                    end, changed = user, True
    later = [n for n in graph.nodes if pos[n] > pos[end] and n.op not in ("output", "get_attr")]
    if not later:
        return False
    # values that depend on the batch or on this unit; parameters of other units carry no ordering
    dependent: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" or node in aliases or \
                any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    live = []
    for node in graph.nodes:
        if pos[node] > pos[end]:
            break
        if node not in dependent or node in aliases:
            continue
        val = node.meta.get("val")
        if val is not None and not (isinstance(val, torch.Tensor) and val.is_floating_point()):
            continue  # ints and tuples carry no gradient; unknown values (no shape meta) pass through
        if any(pos[u] > pos[end] for u in node.users):
            live.append(node)
    with graph.inserting_after(end):
        h = graph.get_attr(f"fsdp_unit_{unit.index}")
    with graph.inserting_after(h):
        call = graph.call_function(dp_ops.fsdp_reshard, (h, *live))
    prev = call
    for j, node in enumerate(live):
        with graph.inserting_after(prev):
            out = graph.call_function(operator.getitem, (call, j))
        out.meta["val"] = node.meta.get("val")
        prev = out
        cut = pos[end]
        node.replace_all_uses_with(out, delete_user_cb=lambda u: u in pos and pos[u] > cut)
    return True
