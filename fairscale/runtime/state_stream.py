"""Full tensors of a rank graph, one at a time: for saving a model larger than one device.

Usage (every rank of a stage's dp and tp groups iterates together; the order is the same on all)::

    for names, full in iter_full_state(rank_gm, aliases=graph.tied):
        ...                           # full: dp- and tp-gathered tensor on the graph's device
    for names, full in iter_optimizer_state(rank_gm, optimizer, aliases=graph.tied):
        ...                           # ["optim.<key>.<state>", ...]: the same, for the optimizer's state

:func:`fairscale.runtime.state.full_state_dict` gathers every tensor of a graph at once, which holds
a whole stage on every rank. These generators gather one parameter, one ZeRO bucket or one FSDP
unit at a time (at most a bucket's or unit's full size is live on the device), so the caller can
move each to the host, send it to rank 0, or keep only its own share before the next one is
gathered (``ParallelModule.state_dict`` and ``fairscale.runtime.engine_checkpoint`` do).

Values are those of ``full_state_dict``: ZeRO buckets give the fp32 master values, tensor-parallel
slices are gathered over their axis (tp or ep), tied names are all emitted.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
import torch.fx

from fairscale.runtime.state import _gather_flat, _optim_targets, gather_tensor_shard, param_layout, tied_aliases
from planner.modpath import fetch_attr as resolve  # the one dotted-path reader
from passes.dp.info import find_dp_info

__all__ = ["iter_full_state", "iter_optimizer_state"]


def _names(key: str, gm: torch.fx.GraphModule, groups: list[list[str]]) -> list[str]:
    """Every user name of ``key``: itself, its aliases inside the graph, and its tied group."""
    names = [key, *tied_aliases(gm).get(key, [])]
    for group in groups:
        if any(n in group for n in names):
            names += [k for k in group if k not in names]
    return names


def iter_full_state(gm: torch.fx.GraphModule, *, aliases: Iterable[Iterable[str]] = (),
                    ) -> Iterator[tuple[list[str], torch.Tensor]]:
    """(user names, full tensor) for every tensor ``gm`` holds, gathered one at a time. Collective
    over the graph's dp and tp groups: every rank of them must run it to the end."""
    layout = param_layout(gm)
    info = find_dp_info(gm)
    groups = [list(g) for g in aliases]
    zero = [b for b in (info.buckets if info is not None and info.kind in ("zero1", "zero2") else [])
            if b.shard is not None]
    master = {k for b in zero for k in b.keys}  # replicas of these may be bf16: the fp32 shard is the value
    for attr, key in layout.keys.items():
        if key in master:
            continue
        try:
            t = resolve(gm, attr)
        except AttributeError:
            continue
        if isinstance(t, torch.Tensor):
            yield _names(key, gm, groups), gather_tensor_shard(key, t.detach(), layout)
    for b in zero:
        full = _gather_flat(b.shard, b.padded, b.axis)
        start = 0
        for key, shape in zip(b.keys, b.shapes):
            piece = full[start:start + shape.numel()].view(shape)
            yield _names(key, gm, groups), gather_tensor_shard(key, piece, layout)
            start += shape.numel()
        del full
    for attr, flat in layout.flat.items():
        full = _gather_flat(resolve(gm, attr), flat.padded, flat.axis)
        for key, piece in flat.split(full[:flat.numel]).items():
            yield _names(key, gm, groups), gather_tensor_shard(key, piece, layout)
        del full


def iter_optimizer_state(gm: torch.fx.GraphModule, optimizer: Any, *, aliases: Iterable[Iterable[str]] = (),
                         ) -> Iterator[tuple[list[str], Any]]:
    """([``optim.<key>.<state name>`` for every user name of the key], value) for ``optimizer``'s
    state in user keys, gathered one bucket or unit at a time: per-element states as full tensors
    (over dp, then over the key's tp or ep axis), scalars (Adam's ``step``) as they are. A tied
    tensor's state is named under each of its names, as :func:`iter_full_state` names the tensor.
    Collective like :func:`iter_full_state`. The param groups are not included
    (``fairscale.runtime.state.optimizer_state_dict`` has them)."""
    layout = param_layout(gm)
    groups = [list(g) for g in aliases]

    def named(key: str, name: str) -> list[str]:
        return [f"optim.{k}.{name}" for k in _names(key, gm, groups)]

    for p, members, padded, _ in _optim_targets(gm, optimizer):
        for name, value in optimizer.state.get(p, {}).items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape != p.shape:
                for key, _ in members:
                    yield named(key, name), value
                continue
            axis = info.axis if (info := find_dp_info(gm)) is not None else "dp"
            full = _gather_flat(value, padded, axis) if padded > 0 else value.reshape(-1)
            start = 0
            for key, shape in members:
                piece = full[start:start + shape.numel()].view(shape)
                yield named(key, name), gather_tensor_shard(key, piece, layout)
                start += shape.numel()
            del full
