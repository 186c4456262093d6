"""FSDP bookkeeping that is not forward/backward: ownership, buffers, metadata, consolidation and
optimizer-state gathering/sharding.

Naming: a *clean* key is the unwrapped module's state_dict key (FSDP/FPW wrapper levels removed);
a *local* key is the key in ``local_state_dict()`` (wrapper levels kept, e.g.
``layers.0._fsdp_wrapped_module.flat_param_0``).

The full optimizer state dict has the layout of a plain ``torch.optim.Optimizer.state_dict()`` on
the unwrapped model: parameters numbered in its ``parameters()`` order, sharded state tensors
(``exp_avg``...) in each parameter's own shape, scalars (``step``) as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

import torch.distributed as dist

from fairscale.nn.misc.flatten_params_wrapper import clean_key
from passes.ops import comm
from passes.layout import FlatShard

if TYPE_CHECKING:
    from fairscale.nn.data_parallel.fully_sharded_data_parallel import FullyShardedDataParallel

_DTYPES_ATTR = "_fsdp_buffer_dtypes"


# ------------------------------------------------------------------------------------------------
# ownership


def walk(module: nn.Module, fsdp_cls: type, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """(dotted path, module) for ``module`` and its descendants, not entering ``fsdp_cls``
    instances (``module`` itself included: an instance wrapping an instance owns nothing of it)."""
    yield prefix, module
    if isinstance(module, fsdp_cls):
        return
    for name, child in module._modules.items():
        if child is None:
            continue
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, fsdp_cls):
            yield path, child
        else:
            yield from walk(child, fsdp_cls, path)


def direct_nested(module: nn.Module, fsdp_cls: type) -> list[Any]:
    """FSDP instances inside ``module`` that are not inside another one."""
    return [m for _, m in walk(module, fsdp_cls) if isinstance(m, fsdp_cls)]


def owned_parameters(module: nn.Module, fsdp_cls: type) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) registered on ``module``'s subtree outside nested FSDP instances (with repeats)."""
    for path, m in walk(module, fsdp_cls):
        if isinstance(m, fsdp_cls):
            continue
        for name, p in m._parameters.items():
            if p is not None:
                yield clean_key(f"{path}.{name}" if path else name), p


def collect_owned(module: nn.Module, fsdp_cls: type) -> tuple[list[nn.Parameter], set[int], list[str]]:
    """(distinct parameters this instance owns, ids of every original parameter it and its nested
    instances cover, unwrapped parameter names in order). Raises on ties across instances."""
    nested = direct_nested(module, fsdp_cls)
    nested_originals: set[int] = set().union(*(m._original_ids for m in nested)) if nested else set()
    owned: list[nn.Parameter] = []
    seen: set[int] = set()
    for name, p in owned_parameters(module, fsdp_cls):
        if id(p) in nested_originals:
            raise ValueError(f"FullyShardedDataParallel: parameter {name!r} is shared with a nested instance (tied "
                             "weights across wrapped submodules); wrap the modules that share it in the same "
                             "instance, e.g. exclude them from auto_wrap")
        if id(p) not in seen:
            seen.add(id(p))
            owned.append(p)
    return owned, {id(p) for p in owned} | nested_originals, original_order(module, nested, fsdp_cls)


def original_order(module: nn.Module, nested: list[Any], fsdp_cls: type) -> list[str]:
    """Clean names of the unwrapped module's parameters in its ``parameters()`` order (tied
    duplicates dropped), with nested instances' names expanded where their subtree sits."""
    owner = {id(p): m for m in nested for p in m.parameters()}
    out: list[str] = []
    done: set[int] = set()
    paths = {id(m): path for path, m in walk(module, fsdp_cls) if isinstance(m, fsdp_cls)}
    for name, p in module.named_parameters():
        m = owner.get(id(p))
        if m is None:
            out.append(clean_key(name))
        elif id(m) not in done:
            done.add(id(m))
            base = clean_key(paths[id(m)] + ".") if paths[id(m)] else ""
            out.extend(base + n for n in m._orig_names)
    return out


def prepare_buffers(module: nn.Module, fsdp_cls: type, dtype: torch.dtype | None, device: torch.device) -> None:
    """Move this instance's buffers to ``device`` and floating ones to ``dtype`` (mixed precision),
    remembering the original dtype so that state_dict() returns them unchanged."""
    for _, m in walk(module, fsdp_cls):
        if isinstance(m, fsdp_cls):
            continue
        for name, b in list(m._buffers.items()):
            if b is None:
                continue
            m.__dict__.setdefault(_DTYPES_ATTR, {}).setdefault(name, b.dtype)
            target = dtype if (dtype is not None and b.is_floating_point()) else b.dtype
            m._buffers[name] = b.to(device=device, dtype=target)


def buffer_dtypes(root: nn.Module) -> dict[str, torch.dtype]:
    """Clean buffer key -> original dtype, over ``root``'s whole tree."""
    out = {}
    for path, m in root.named_modules():
        for name, dtype in m.__dict__.get(_DTYPES_ATTR, {}).items():
            out[clean_key(f"{path}.{name}" if path else name)] = dtype
    return out


def _units_by_flat(root: FullyShardedDataParallel) -> dict[int, tuple[Any, Any, str]]:
    """id(shard parameter) -> (instance, unit, clean prefix of the instance)."""
    out = {}
    for path, m in root._instances():
        base = clean_key(path + ".") if path else ""
        for u in m._units:
            out[id(u.flat)] = (m, u, base)
    return out


# ------------------------------------------------------------------------------------------------
# local state dicts: metadata and consolidation


def metadata(root: FullyShardedDataParallel) -> dict[str, Any]:
    names: dict[int, str] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    units = []
    for inst, u, base in _units_by_flat(root).values():
        units.append({
            "local_key": names[id(u.flat)],
            "members": [(base + k, tuple(s)) for k, s in u.layout.members],
            "aliases": {base + a: base + k for a, k in u.group.aliases.items()},
            "numel": u.layout.numel, "padded": u.layout.padded,
            "index": u.layout.index, "count": u.layout.count,
        })
    buffers = {}
    dtypes = buffer_dtypes(root)
    persistent = set(root.local_state_dict())  # non-persistent buffers are in no state dict
    for name, _ in root.named_buffers():
        if name in persistent:
            key = clean_key(name)
            buffers[name] = (key, dtypes.get(key))
    return {"version": 1, "world_size": root.world_size, "rank": root.rank, "units": units, "buffers": buffers}


def consolidate(shard_weights: list[dict[str, torch.Tensor]], shard_metadata: list[dict[str, Any]], *,
                with_module_buffers: bool, strict: bool) -> dict[str, torch.Tensor]:
    if not shard_weights or len(shard_weights) != len(shard_metadata):
        raise ValueError(f"consolidate_shard_weights needs one state dict and one metadata dict per rank, got "
                         f"{len(shard_weights)} and {len(shard_metadata)}")
    n = len(shard_weights)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for j, unit in enumerate(shard_metadata[0]["units"]):
        if unit["count"] != n:
            raise ValueError(f"{unit['local_key']}: sharded over {unit['count']} ranks but {n} shards were given; "
                             "pass every rank's local_state_dict() and local_metadata_dict(), in rank order")
        by_index = sorted(range(n), key=lambda r: shard_metadata[r]["units"][j]["index"])
        key = unit["local_key"]
        missing = [r for r in by_index if key not in shard_weights[r]]
        if missing:
            raise KeyError(f"consolidate_shard_weights: {key!r} missing from the state dicts of ranks {missing}")
        full = torch.cat([shard_weights[r][key].reshape(-1) for r in by_index])[:unit["numel"]]
        layout = FlatShard(members=[(k, tuple(s)) for k, s in unit["members"]], numel=unit["numel"],
                           padded=unit["padded"], index=0, count=n)
        for k, t in layout.split(full).items():
            out[k] = t.clone()
        for alias, src in unit["aliases"].items():
            out[alias] = out[src]
        used.add(key)
    buffer_keys = set(shard_metadata[0]["buffers"])
    if with_module_buffers:
        for local, (key, dtype) in shard_metadata[0]["buffers"].items():
            if local not in shard_weights[0]:
                if strict:
                    raise KeyError(f"consolidate_shard_weights: buffer {local!r} missing from rank 0's state dict")
                continue
            value = shard_weights[0][local]
            out[key] = value.to(dtype) if dtype is not None else value
    if strict:
        extra = sorted(set(shard_weights[0]) - used - buffer_keys)
        if extra:
            raise KeyError(f"consolidate_shard_weights: keys not described by the metadata: {extra[:5]} "
                           "(pass strict=False to drop them)")
    return out


# ------------------------------------------------------------------------------------------------
# optimizer state


def _is_sharded_state(value: Any, shard_numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == shard_numel


def gather_optim(root: FullyShardedDataParallel, optim: torch.optim.Optimizer) -> dict[str, Any]:
    osd = optim.state_dict()
    units = _units_by_flat(root)
    order = {name: i for i, name in enumerate(root._orig_names)}
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for group, saved in zip(optim.param_groups, osd["param_groups"]):
        ids: list[int] = []
        for p, sid in zip(group["params"], saved["params"]):
            entry = units.get(id(p))
            if entry is None:
                raise ValueError("gather_full_optim_state_dict: the optimizer holds a parameter that this FSDP module "
                                 "does not manage; build the optimizer over fsdp_model.parameters()")
            inst, u, base = entry
            names = [base + k for k, _ in u.layout.members]
            ids.extend(order[n] for n in names if n in order)
            st = osd["state"].get(sid)
            if not st:
                continue
            per_member: list[dict[str, Any]] = [{} for _ in names]
            for key, value in st.items():
                if _is_sharded_state(value, u.layout.shard_numel):
                    device = u.op.compute_device  # where the backend can communicate
                    full = torch.empty(u.layout.padded, dtype=value.dtype, device=device)
                    comm.all_gather_flat(full, value.detach().to(device), u.op.axis)
                    full = full.to(value.device)
                    for i, t in enumerate(u.layout.split(full[:u.layout.numel]).values()):
                        per_member[i][key] = t.clone()
                else:
                    for d in per_member:
                        d[key] = value.clone() if isinstance(value, torch.Tensor) else value
            for n, d in zip(names, per_member):
                if n in order:
                    state[order[n]] = d
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": sorted(ids)})
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def shard_optim(root: FullyShardedDataParallel, full: dict[str, Any]) -> dict[str, Any]:
    order = {name: i for i, name in enumerate(root._orig_names)}
    units = _units_by_flat(root)
    group_of = {pid: gi for gi, g in enumerate(full["param_groups"]) for pid in g["params"]}
    state: dict[int, dict[str, Any]] = {}
    group_params: list[list[int]] = [[] for _ in full["param_groups"]]
    for local_id, p in enumerate(root.parameters()):
        inst, u, base = units[id(p)]
        ids = [order.get(base + k) for k, _ in u.layout.members]
        known = [i for i in ids if i is not None]
        if not known:
            raise KeyError(f"get_shard_from_optim_state_dict: no parameter of {u.layout.members[0][0]!r}'s unit "
                           "is numbered in this model")
        group_params[group_of.get(known[0], 0)].append(local_id)
        states: list[Any] = [full["state"].get(i) if i is not None else None for i in ids]
        if all(s is None for s in states):
            continue
        if any(s is None for s in states):
            raise KeyError(f"get_shard_from_optim_state_dict: optimizer state covers only part of the unit holding "
                           f"{[base + k for k, _ in u.layout.members][:3]}")
        st: dict[str, Any] = {}
        for key, v0 in states[0].items():
            values = [s[key] for s in states]
            sharded = all(isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(shape) and v.dim() > 0
                          for v, (_, shape) in zip(values, u.layout.members))
            if sharded:
                flat = torch.cat([v.reshape(-1) for v in values]).to(device=p.device)
                padded = torch.zeros(u.layout.padded, dtype=flat.dtype, device=flat.device)
                padded[:flat.numel()] = flat
                lo, hi = u.shard_range()
                st[key] = padded[lo:hi].clone()
            else:
                st[key] = v0.clone() if isinstance(v0, torch.Tensor) else v0
        state[local_id] = st
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": ids}
              for g, ids in zip(full["param_groups"], group_params)]
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------------------------------------
# clipping


@torch.no_grad()
def clip_grad_norm(grads: list[torch.Tensor], max_norm: float, norm_type: float, *, axis: str,
                   device: torch.device) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over gradient shards: the p-th powers (or the max) are
    reduced over ``axis`` so every rank clips by the norm of the whole model. Zero padding adds 0."""
    norm_type = float(norm_type)
    dev = grads[0].device if grads else device
    if norm_type == float("inf"):
        total = torch.stack([g.abs().max().float() for g in grads]).max() if grads else torch.zeros((), device=dev)
        total = total.to(device)  # reduce where the backend can communicate (grads may be on the CPU)
        comm.all_reduce_(total, axis, op=dist.ReduceOp.MAX)
    else:
        local = sum((g.float().norm(norm_type) ** norm_type for g in grads), torch.zeros((), device=dev)).to(device)
        comm.all_reduce_(local, axis)
        total = local ** (1.0 / norm_type)
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return total
