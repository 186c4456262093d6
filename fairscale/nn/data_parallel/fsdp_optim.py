"""FSDP's full optimizer state dict, in FairScale 0.4.13's layout.

``gather_full_optim_state_dict`` returns, on rank 0, the optimizer's state unflattened and unsharded:

    {"param_groups": [...], "state": {global id: {"step": 3.0, "exp_avg": <full shape>, ...}},
     "param_id_map": {global id: local id or None}, "uncollected_local_ids": [...]}

Global ids number the original parameters as 0.4.13 did: instance by instance, the root first and
then the nested ones in module order (``root.parameters()`` order of the flat parameters), and
within an instance in flattening order. For a model with nested instances that is not the
unwrapped model's ``parameters()`` order::

    root owns embed, ln      layers.0 owns fc1, fc2      unwrapped order: embed fc1 fc2 ln
    global ids:  embed 0, ln 1, layers.0.fc1 2, layers.0.fc2 3

A local id is the optimizer's own index of the flat parameter. ``step`` is a Python number
(0.4.13 converted Adam's singleton tensor back with ``.item()``); another 0-dim tensor is kept per
rank, as a list. ``get_shard_from_optim_state_dict`` reads this layout (a 0.4.13 checkpoint's
too); a dict without ``param_id_map``, as this package wrote before, is read by unwrapped order.
"""

from __future__ import annotations

from typing import Any

import torch

from fairscale.nn.data_parallel.fsdp_state import _units_by_flat
from passes.ops import comm

FullyShardedDataParallel = Any  # see fsdp_state


def _first_ids(root: FullyShardedDataParallel, units: dict[int, tuple[Any, Any, str]]) -> dict[int, int]:
    """id(flat parameter) -> the global id of its first member, in 0.4.13's numbering."""
    out, nxt = {}, 0
    for p in root.parameters():
        out[id(p)] = nxt
        nxt += len(units[id(p)][1].layout.members)
    return out


def _is_sharded_state(value: Any, shard: torch.Tensor) -> bool:
    """A state tensor shaped like the shard parameter (1-D, or a whole world-1 parameter's shape)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shard.shape


def _gather(value: torch.Tensor, u: Any) -> torch.Tensor:
    """The unsharded flat tensor (padding included) of a state tensor shaped like ``u``'s shard."""
    device = u.op.compute_device  # where the backend can communicate
    full = torch.empty(u.layout.padded, dtype=value.dtype, device=device)
    comm.all_gather_flat(full, value.detach().to(device), u.op.axis)
    return full.to(value.device)


def _per_rank(value: torch.Tensor, u: Any) -> list[torch.Tensor]:
    """A 0-dim state tensor of every rank of ``u``'s group, on the CPU (0.4.13's singleton state)."""
    device = u.op.compute_device
    out = torch.empty(u.layout.count, dtype=value.dtype, device=device)
    comm.all_gather_flat(out, value.detach().reshape(1).to(device), u.op.axis)
    return [t.squeeze().cpu() for t in out.chunk(u.layout.count)]


def gather_optim(root: FullyShardedDataParallel, optim: torch.optim.Optimizer) -> dict[str, Any]:
    osd = optim.state_dict()
    units = _units_by_flat(root)
    first = _first_ids(root, units)
    total = sum(len(u.layout.members) for _, u, _ in units.values())
    state: dict[int, dict[str, Any]] = {}
    id_map: dict[int, int | None] = dict.fromkeys(range(total))
    groups: list[dict[str, Any]] = []
    uncollected: list[int] = []
    for group, saved in zip(optim.param_groups, osd["param_groups"]):
        ids: list[int] = []
        for p, sid in zip(group["params"], saved["params"]):
            entry = units.get(id(p))
            if entry is None:
                raise ValueError("gather_full_optim_state_dict: the optimizer holds a parameter that this FSDP module "
                                 "does not manage; build the optimizer over fsdp_model.parameters()")
            inst, u, _ = entry
            gids = list(range(first[id(p)], first[id(p)] + len(u.layout.members)))
            ids.extend(gids)
            if inst.no_broadcast_optim_state:
                uncollected.append(sid)
            st = osd["state"].get(sid)
            if not st:
                continue
            id_map.update(dict.fromkeys(gids, sid))
            per_member: list[dict[str, Any]] = [{} for _ in gids]
            for key, value in st.items():
                if _is_sharded_state(value, u.flat):
                    pieces = list(u.layout.split(_gather(value, u)[:u.layout.numel]).values())
                    for d, t in zip(per_member, pieces):
                        d[key] = t.clone()
                    continue
                if isinstance(value, torch.Tensor) and value.dim() == 0:
                    value = value.item() if key == "step" else _per_rank(value, u)
                for d in per_member:
                    d[key] = value.clone() if isinstance(value, torch.Tensor) else value
            state.update(zip(gids, per_member))
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": sorted(ids)})
    return {"param_groups": groups, "state": dict(sorted(state.items())), "param_id_map": id_map,
            "uncollected_local_ids": uncollected}


def _member_ids(root: FullyShardedDataParallel, units: dict[int, tuple[Any, Any, str]],
                full: dict[str, Any]) -> dict[int, list[int | None]]:
    """id(flat parameter) -> the global id of each member in ``full``'s numbering."""
    if "param_id_map" in full:
        total = sum(len(u.layout.members) for _, u, _ in units.values())
        if len(full["param_id_map"]) != total:
            raise ValueError(f"get_shard_from_optim_state_dict: the optimizer state numbers "
                             f"{len(full['param_id_map'])} parameters but this model's FSDP instances hold {total}; "
                             "wrap the model as it was wrapped when the state was gathered")
        first = _first_ids(root, units)
        return {k: list(range(v, v + len(units[k][1].layout.members))) for k, v in first.items()}
    order = {name: i for i, name in enumerate(root._orig_names)}  # unwrapped parameters() order
    return {id(p): [order.get(base + k) for k, _ in u.layout.members] for p, (_, u, base) in
            ((p, units[id(p)]) for p in root.parameters())}


def shard_optim(root: FullyShardedDataParallel, full: dict[str, Any]) -> dict[str, Any]:
    units = _units_by_flat(root)
    member_ids = _member_ids(root, units, full)
    group_of = {pid: gi for gi, g in enumerate(full["param_groups"]) for pid in g["params"]}
    state: dict[int, dict[str, Any]] = {}
    group_params: list[list[int]] = [[] for _ in full["param_groups"]]
    for local_id, p in enumerate(root.parameters()):
        _, u, base = units[id(p)]
        ids = member_ids[id(p)]
        names = [base + k for k, _ in u.layout.members]
        known = [i for i in ids if i is not None]
        if not known:
            raise KeyError(f"get_shard_from_optim_state_dict: no parameter of {names[0]!r}'s unit "
                           "is numbered in this model")
        group_params[group_of.get(known[0], 0)].append(local_id)
        states: list[Any] = [full["state"].get(i) if i is not None else None for i in ids]
        if all(s is None for s in states):
            continue
        if any(s is None for s in states):
            raise KeyError(f"get_shard_from_optim_state_dict: optimizer state covers only part of the unit holding "
                           f"{names[:3]}")
        st: dict[str, Any] = {}
        for key, v0 in states[0].items():
            values = [s[key] for s in states]
            # a member's own state: shaped like it (a scalar parameter's 0-dim, first in its unit or not;
            # gather_optim stores what is not a member's own as a number or a per-rank list)
            if any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values) or (key != "step" and p.dim() > 0 and all(
                    isinstance(v, torch.Tensor) and v.dim() == 0 for v in values)):
                for v, name, (_, shape) in zip(values, names, u.layout.members):
                    if tuple(v.shape) != tuple(shape):
                        raise ValueError(f"get_shard_from_optim_state_dict: state {key!r} of {name!r} has shape "
                                         f"{tuple(v.shape)}, the parameter {tuple(shape)}; the state was gathered "
                                         "from another model or wrapping")
                flat = torch.cat([v.reshape(-1) for v in values]).to(device=p.device)
                padded = torch.zeros(u.layout.padded, dtype=flat.dtype, device=flat.device)
                padded[:flat.numel()] = flat
                lo, hi = u.shard_range()
                st[key] = padded[lo:hi].clone().view(p.shape)
            elif isinstance(v0, list) and v0 and isinstance(v0[0], torch.Tensor) and v0[0].dim() == 0:
                st[key] = v0[0] if root.rank >= len(v0) else v0[root.rank]  # 0.4.13's rule for other world sizes
            else:
                st[key] = v0.clone() if isinstance(v0, torch.Tensor) else v0
        state[local_id] = st
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": ids}
              for g, ids in zip(full["param_groups"], group_params)]
    return {"state": state, "param_groups": groups}
