"""State dicts of rank graphs in the user's keys: full (gathered on rank 0) and sharded.

Usage::

    full = full_state_dict(rank_gm, aliases=graph.tied)        # rank 0: {key: tensor}; others: {}
    load_full_state_dict(rank_gm, full)                        # every rank passes the same dict
    shard = sharded_state_dict(rank_gm, dp_mesh)               # {key: DTensor Shard(0) on dp}
    load_sharded_state_dict(rank_gm, shard)
    opt_state = optimizer_state_dict(rank_gm, opt, dp_mesh)    # {"optim.<key>.<name>": ...}
    grads = full_grads(rank_gm, aliases=graph.tied)            # rank 0: {key: full gradient}

Smaller pieces for other savers (``fairscale.runtime.engine_checkpoint``): :func:`param_layout`,
:func:`held_keys`, :func:`tied_aliases`, :func:`gather_tensor_shard`,
:func:`load_optimizer_state_dict`.

The sharded form stores every parameter as a DTensor sharded along dim 0 over the dp mesh
(``torch.chunk`` layout), whatever kind produced it, so a checkpoint written by FSDP on 4 ranks
loads into DDP or FSDP on 2 (``fairscale.runtime.checkpoint``), and PyTorch FSDP2 uses the same
layout. Optimizer state is stored the same way under ``optim.<key>.<state name>``.

Limits: tensor-parallel slices are gathered over ``tp`` in the full state dict; the sharded form
covers dp only (a tp > 1 checkpoint needs 2-D placements; the engine's checkpoint adds them).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed.device_mesh import DeviceMesh

from passes.ops import comm
from planner.modpath import fetch_attr as resolve  # the one dotted-path reader
from passes.layout import INSIDE_DP, ParamLayout, find_layout
from passes.dp.info import DataParallelInfo, find_dp_info

if TYPE_CHECKING:  # DTensor (and torch.distributed.checkpoint, in the savers) are imported where used:
    # they cost about a second at import, and planning (fairscale plan, fairscale.plan) never uses them
    from torch.distributed.tensor import DTensor

__all__ = ["full_state_dict", "full_grads", "local_grads", "load_full_state_dict", "sharded_state_dict", "load_sharded_state_dict",
           "local_tensors", "param_layout", "tied_aliases", "held_keys", "gather_tensor_shard",
           "optimizer_state_dict", "load_optimizer_state_dict"]


def param_layout(gm: torch.fx.GraphModule) -> ParamLayout:
    """The :class:`~passes.layout.ParamLayout` the passes recorded on ``gm`` (raises if there is none)."""
    layout = find_layout(gm)
    if layout is None:
        raise ValueError("the GraphModule has no parameter layout (gm.meta['fs_layout']); build it with "
                         "planner.capture and the passes")
    return layout


def _gather_flat(shard: torch.Tensor, padded: int, axis: str) -> torch.Tensor:
    full = torch.empty(padded, dtype=shard.dtype, device=shard.device)
    comm.all_gather_flat(full, shard.detach().contiguous(), axis)
    return full


def _zero_full(gm: torch.fx.GraphModule, info: DataParallelInfo, states: dict[int, torch.Tensor] | None = None,
               ) -> dict[str, torch.Tensor]:
    """key -> full tensor from the zero buckets' master shards (or from ``states``: id(shard) -> tensor
    of shard shape, e.g. an optimizer moment)."""
    out: dict[str, torch.Tensor] = {}
    for b in info.buckets:
        if b.shard is None:
            continue
        src = b.shard if states is None else states.get(id(b.shard))
        if src is None:
            continue
        full = _gather_flat(src, b.padded, info.axis)
        start = 0
        for key, shape in zip(b.keys, b.shapes):
            out[key] = full[start:start + shape.numel()].view(shape).clone()
            start += shape.numel()
    return out


def local_tensors(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """Every user key this rank can produce, as full (dp-unsharded) tensors; collective (call on
    every rank of the dp axis). Tensor-parallel slices stay local here."""
    layout = param_layout(gm)
    info = find_dp_info(gm)
    out: dict[str, torch.Tensor] = {}
    for attr, key in layout.keys.items():
        try:
            out[key] = resolve(gm, attr).detach()
        except AttributeError:
            continue
    if info is not None and info.kind in ("zero1", "zero2"):
        out.update(_zero_full(gm, info))  # fp32 master values, even when replicas are bf16
    for attr, flat in layout.flat.items():
        shard = resolve(gm, attr)
        full = _gather_flat(shard, flat.padded, flat.axis)
        for key, t in flat.split(full[:flat.numel]).items():
            out[key] = t.clone()
    for key, others in (info.aliases.items() if info is not None else []):
        for other in others:
            if key in out:
                out[other] = out[key]
    return out


def tied_aliases(gm: torch.fx.GraphModule) -> dict[str, list[str]]:
    """Tied tensors of ``gm``: the user key it holds -> the user's other keys for the same tensor."""
    info = find_dp_info(gm)
    return info.aliases if info is not None else {}


def gather_tensor_shard(key: str, t: torch.Tensor, layout: ParamLayout) -> torch.Tensor:
    """The full tensor ``key`` from this rank's slice ``t`` (``layout.tp[key]``), all-gathered over
    the slice's own axis (tp, ep, ...); ``t`` itself when ``key`` is not sliced. Collective over that axis."""
    spec = layout.tp.get(key)
    if spec is None or comm.group_size(spec.axis) == 1:
        return t
    pieces = [torch.empty_like(t) for _ in range(spec.count)]
    dist.all_gather(pieces, t.contiguous(), group=comm.get_group(spec.axis))
    return spec.assemble(pieces)


def full_state_dict(gm: torch.fx.GraphModule, *, aliases: Iterable[Iterable[str]] = (),
                    rank0_only: bool = True, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The user's full state_dict, gathered. Collective: every rank calls it.

    Args:
        aliases: groups of tied keys (``ModelGraph.tied``); every key of a group gets the tensor.
        rank0_only: only global rank 0 returns tensors (others get ``{}``).
        cpu: move tensors to the CPU.
    """
    layout = param_layout(gm)
    out = {k: gather_tensor_shard(k, v, layout) for k, v in local_tensors(gm).items()}
    for group in aliases:
        group = list(group)
        have = next((k for k in group if k in out), None)
        if have is not None:
            for k in group:
                out.setdefault(k, out[have])
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return {k: (v.cpu() if cpu else v).clone() for k, v in out.items()}


@torch.no_grad()
def load_full_state_dict(gm: torch.fx.GraphModule, state: dict[str, torch.Tensor]) -> None:
    """Copy a full state_dict (user keys; every rank passes it) into this rank's tensors."""
    layout = param_layout(gm)
    info = find_dp_info(gm)

    aliases = tied_aliases(gm)
    state = dict(state)
    for key, others in aliases.items():  # a tied tensor may have been saved under any of its names
        if key not in state:
            found = next((o for o in others if o in state), None)
            if found is not None:
                state[key] = state[found]

    def local(key: str, full: torch.Tensor) -> torch.Tensor:
        spec = layout.tp.get(key)
        return spec.slice(full) if spec is not None else full

    missing = [k for k in held_keys(gm) if k not in state]
    if missing:
        raise KeyError(f"state dict lacks {len(missing)} key(s) this rank holds, e.g. {missing[:5]}")
    for attr, key in layout.keys.items():
        try:
            t = resolve(gm, attr)
        except AttributeError:
            continue
        t.copy_(local(key, state[key]))
    if info is not None:
        for b in info.buckets:
            if b.shard is None:
                continue
            flat = torch.zeros(b.padded, dtype=b.shard.dtype, device=b.shard.device)
            start = 0
            for key, shape in zip(b.keys, b.shapes):
                flat[start:start + shape.numel()] = local(key, state[key]).reshape(-1)
                start += shape.numel()
            lo, hi = b.shard_range
            b.shard.copy_(flat[lo:hi])
    for attr, flat_spec in layout.flat.items():
        shard = resolve(gm, attr)
        full = torch.zeros(flat_spec.padded, dtype=shard.dtype, device=shard.device)
        for (key, start, n) in flat_spec.offsets():
            full[start:start + n] = local(key, state[key]).reshape(-1)
        per = flat_spec.shard_numel
        shard.copy_(full[flat_spec.index * per:(flat_spec.index + 1) * per])
    for unit in (info.units if info is not None else []):
        unit.free()


def held_keys(gm: torch.fx.GraphModule) -> list[str]:
    """User keys of every tensor ``gm`` holds: whole (or sliced) parameters and buffers, and the
    members of its FSDP flat shards (one name per tied group; see :func:`tied_aliases`)."""
    layout = param_layout(gm)
    keys = list(layout.keys.values())
    for flat in layout.flat.values():
        keys += [k for k, _ in flat.members]
    return keys


def _to_dtensor(full: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """This rank's ``torch.chunk`` piece of ``full`` along dim 0, as a DTensor Shard(0) on ``mesh``."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(_chunk0(full, mesh), mesh, [Shard(0)], run_check=False,
                              shape=full.shape, stride=full.contiguous().stride())


def _chunk0(full: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    n, i = mesh.size(), mesh.get_local_rank()
    if full.dim() == 0:
        return full.clone()
    per = -(-full.shape[0] // n)
    return full[min(i * per, full.shape[0]):min((i + 1) * per, full.shape[0])].clone()


def sharded_state_dict(gm: torch.fx.GraphModule, mesh: DeviceMesh, *, optimizer: Any = None) -> dict[str, Any]:
    """Parameters (and ``optimizer`` state, if given) as DTensors sharded on dim 0 over ``mesh``
    (the dp mesh). Collective. Scalars and 0-d tensors (Adam's ``step``) are stored replicated."""
    state: dict[str, Any] = {}
    for key, full in local_tensors(gm).items():
        state[key] = _to_dtensor(full, mesh) if full.dim() > 0 else full.clone()
    if optimizer is not None:
        state.update(optimizer_state_dict(gm, optimizer, mesh))
    return state


@torch.no_grad()
def load_sharded_state_dict(gm: torch.fx.GraphModule, state: dict[str, Any], *, optimizer: Any = None) -> None:
    """Inverse of :func:`sharded_state_dict` (DTensors may come from another dp size)."""
    from torch.distributed.tensor import DTensor

    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state.items()}
    load_full_state_dict(gm, {k: v for k, v in full.items() if not k.startswith("optim.")})
    if optimizer is not None:
        load_optimizer_state_dict(gm, optimizer, full)


# -- optimizer state in user keys -----------------------------------------------------------------


def _optim_targets(gm: torch.fx.GraphModule, optimizer: Any) -> list[tuple[torch.Tensor, list[tuple[str, torch.Size]], int, int]]:
    """(optimizer param, [(key, shape)], padded, shard offset) for each tensor the optimizer steps."""
    layout = param_layout(gm)
    info = find_dp_info(gm)
    out = []
    if info is not None and info.kind in ("zero1", "zero2", "fsdp"):
        for b in info.buckets:
            if b.shard is not None:
                out.append((b.shard, list(zip(b.keys, b.shapes)), b.padded, 0))
            elif b.kind == "ddp":  # compiled with replicate=: whole parameters, plain optimizer state
                out.extend((p, [(k, s)], -1, 0) for p, k, s in zip(b.params, b.keys, b.shapes))
        for attr, flat in layout.flat.items():
            out.append((resolve(gm, attr), [(k, torch.Size(s)) for k, s in flat.members], flat.padded, 0))
    else:
        by_id = {id(resolve(gm, a)): k for a, k in layout.keys.items() if _is_param(gm, a)}
        for p in optimizer.params:
            out.append((p, [(by_id[id(p)], p.shape)], -1, 0))
    return out


def _is_param(gm: torch.fx.GraphModule, attr: str) -> bool:
    try:
        return isinstance(resolve(gm, attr), torch.nn.Parameter)
    except AttributeError:
        return False


def optimizer_state_dict(gm: torch.fx.GraphModule, optimizer: Any, mesh: DeviceMesh) -> dict[str, Any]:
    """``optimizer``'s state in user keys: ``optim.<key>.<state name>`` as DTensors sharded on dim 0
    over ``mesh`` (the dp mesh; tensor-parallel slices stay local), scalars (Adam's ``step``) as
    plain tensors, and ``optim.param_groups`` as one JSON string. Collective over dp. States of
    tensors sharded on an axis inside dp (expert parallelism, ``passes.layout.INSIDE_DP``) are this
    rank's plain tensors: they differ between dp ranks."""
    out: dict[str, Any] = {}
    layout = param_layout(gm)
    axis = info.axis if (info := find_dp_info(gm)) is not None else "dp"
    for p, members, padded, _ in _optim_targets(gm, optimizer):
        st = optimizer.state.get(p, {})
        for name, value in st.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape != p.shape:
                for key, _ in members:
                    # lint: cpu -- a Python scalar of the state, saved as a host tensor
                    out[f"optim.{key}.{name}"] = value.clone() if isinstance(value, torch.Tensor) else \
                        torch.tensor(value, device="cpu")
                continue
            full = _gather_flat(value, padded, axis) if padded > 0 else value.reshape(-1)
            start = 0
            for key, shape in members:
                piece = full[start:start + shape.numel()].view(shape)
                spec = layout.tp.get(key)
                # an expert shard differs between dp ranks: it stays local, not a DTensor over dp
                local = spec is not None and spec.axis in INSIDE_DP
                out[f"optim.{key}.{name}"] = piece.clone() if local else _to_dtensor(piece, mesh)
                start += shape.numel()
    # one string (a leaf for DCP, which would otherwise flatten the list of dicts into many keys)
    out["optim.param_groups"] = json.dumps([{k: v for k, v in g.items() if k != "params"}
                                            for g in optimizer.param_groups], default=str)
    return out


def load_optimizer_state_dict(gm: torch.fx.GraphModule, optimizer: Any, full: dict[str, Any]) -> None:
    """Inverse of :func:`optimizer_state_dict`: ``full`` maps ``optim.<key>.<name>`` to full
    (dp-unsharded, this rank's tensor-parallel slice) tensors; this rank takes its shards. Local."""
    info = find_dp_info(gm)
    n, i = (info.dp_size, info.dp_index) if info is not None else (1, 0)
    full = dict(full)
    for key, others in tied_aliases(gm).items():  # saved under another name of a tied tensor
        for other in others:
            for k in [k for k in full if k.startswith(f"optim.{other}.")]:
                full.setdefault(f"optim.{key}." + k[len(f"optim.{other}."):], full[k])
    groups_of = {id(q): g for g in optimizer.param_groups for q in g["params"]}
    for p, members, padded, _ in _optim_targets(gm, optimizer):
        names = {k.rsplit(".", 1)[1] for k in full if k.startswith(f"optim.{members[0][0]}.")}
        st: dict[str, Any] = {}
        for name in names:
            first = full[f"optim.{members[0][0]}.{name}"]
            if first.dim() == 0:  # scalar state (Adam's step): the same for every member
                st[name] = _scalar_state(p, name, first, groups_of.get(id(p), {}))
                continue
            flat = torch.cat([full[f"optim.{k}.{name}"].reshape(-1) for k, _ in members])
            if padded > 0:
                flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
                per = padded // n
                st[name] = flat[i * per:(i + 1) * per].to(device=p.device, dtype=p.dtype, copy=True)
            else:
                st[name] = flat.view(p.shape).to(device=p.device, dtype=p.dtype, copy=True)
        if st:
            optimizer.state[p] = st
    groups = full.get("optim.param_groups")
    if isinstance(groups, str):
        groups = json.loads(groups)
    if groups:
        for g, saved in zip(optimizer.param_groups, groups):
            for k, v in saved.items():  # numeric hyperparameters (lr, betas, eps, weight_decay ...)
                cur = g.get(k)
                number = isinstance(v, (int, float)) and not isinstance(v, bool)
                if number and (k not in g or isinstance(cur, (int, float)) and not isinstance(cur, bool)):
                    g[k] = v  # absent ones are a scheduler's (initial_lr; OneCycleLR's max_lr, min_lr)
                elif isinstance(cur, tuple) and isinstance(v, list):
                    g[k] = tuple(v)


def _scalar_state(p: torch.Tensor, name: str, value: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """A 0-d optimizer state where ``torch.optim.Optimizer.load_state_dict`` would put it: ``step``
    stays a float32 host tensor unless the group is ``capturable`` or ``fused`` (then on ``p``'s
    device); any other scalar follows ``p``'s device (and dtype, when both are floating point)."""
    if name == "step":
        if group.get("capturable") or group.get("fused"):
            return value.to(device=p.device, dtype=torch.float32, copy=True)
        return value.to(dtype=torch.float32, copy=True) if value.is_floating_point() else value.clone()
    if value.is_floating_point() and p.is_floating_point():
        return value.to(device=p.device, dtype=p.dtype, copy=True)
    return value.to(device=p.device, copy=True)


# -- gradients in user keys (fairscale check, exactness tests) ----------------------------------


def _gather_flat_uncounted(shard: torch.Tensor, padded: int, axis: str) -> torch.Tensor:
    """All-gather equal flat shards over ``axis`` into ``padded`` elements, outside
    ``comm.COUNTER``: reading gradients back is inspection, not the model's traffic."""
    n = comm.group_size(axis)
    shard = shard.detach().reshape(-1).contiguous()
    if n == 1:
        return shard.clone()
    full = torch.empty(padded, dtype=shard.dtype, device=shard.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(full, shard, group=comm.get_group(axis))
    return full


def local_grads(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """user key -> this rank's gradient of that tensor, whole over dp (shards of ZeRO buckets and
    FSDP units are all-gathered over their axis), tensor-parallel and expert slices still local.
    Collective over the dp axis. Keys whose tensor has no gradient (frozen, or unused this step
    under ddp) are absent; a sharded holder without a gradient yet contributes zeros, because the
    gather must run on every rank alike.

    Read it after backward: ddp/zero1 replicas and kept-whole tensors hold the averaged gradient
    in ``.grad``; zero buckets hold it in their fp32 master shard, FSDP units in their flat shard."""
    layout = param_layout(gm)
    info = find_dp_info(gm)
    out: dict[str, torch.Tensor] = {}
    for attr, key in layout.keys.items():
        try:
            t = resolve(gm, attr)
        except AttributeError:
            continue
        if isinstance(t, torch.nn.Parameter) and t.grad is not None:
            out[key] = t.grad.detach()
    sharded = [(b.shard, b.padded, b.axis, list(zip(b.keys, b.shapes))) for b in (info.buckets if info else [])
               if b.shard is not None]
    for attr, flat in layout.flat.items():
        sharded.append((resolve(gm, attr), flat.padded, flat.axis,
                        [(k, torch.Size(s)) for k, s in flat.members]))
    for shard, padded, axis, members in sharded:
        g = shard.grad if shard.grad is not None else torch.zeros_like(shard)
        full = _gather_flat_uncounted(g, padded, axis)
        start = 0
        for key, shape in members:
            out[key] = full[start:start + shape.numel()].view(shape)
            start += shape.numel()
    for key, others in (info.aliases.items() if info is not None else []):
        for other in others:
            if key in out:
                out[other] = out[key]
    return out


def full_grads(gm: torch.fx.GraphModule, *, aliases: Iterable[Iterable[str]] = (), rank0_only: bool = True,
               cpu: bool = True) -> dict[str, torch.Tensor]:
    """The full gradients of the user's parameters, keyed like ``model.state_dict()``: shards
    gathered over dp, slices over tp and ep. Collective: every rank of the graph's dp, tp and ep
    groups calls it. Same arguments as :func:`full_state_dict`; the gradient of a tied group is
    given under every name of the group."""
    layout = param_layout(gm)
    out = {k: gather_tensor_shard(k, v, layout) for k, v in local_grads(gm).items()}
    for group in aliases:
        group = list(group)
        have = next((k for k in group if k in out), None)
        if have is not None:
            for k in group:
                out.setdefault(k, out[have])
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return {k: (v.cpu() if cpu else v).clone() for k, v in out.items()}
