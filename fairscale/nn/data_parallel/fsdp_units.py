"""The sharded units of one FullyShardedDataParallel instance, built on the compiler's FSDP ops.

A *unit* is one flat parameter: a :class:`passes.ops.dp_ops.FSDPUnit` whose ``flat`` is this rank's
padded 1/n shard (the tensor the optimizer updates), plus the :class:`FlatGroup` that says which
module attributes its members are bound to. The collective pairing is the compiler pass's own
(``passes.ops.dp_ops.fsdp_unshard``): all-gather in forward, reduce-scatter (sum, then divide by n)
into ``flat.grad`` in backward, which also frees the gathered buffer. What this module adds:

* :func:`pre_backward`: an identity on a forward's outputs whose backward gathers the units again
  before any backward op that reads them runs; its forward frees them when resharding after forward.
  (``passes.ops.dp_ops.fsdp_reshard`` does this for one unit and always frees; an FSDP instance has
  one to a few units, and ``reshard_after_forward=False`` must keep them.)
* :func:`gather_full`: the full-precision gather that ``summon_full_params`` and the state-dict
  methods use (the forward gather is in the compute dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from fairscale.nn.misc.flatten_params_wrapper import FlatGroup, FlattenParamsWrapper
from passes.ops import comm
from passes.ops.dp_ops import FSDPUnit
from passes.layout import FlatShard

__all__ = ["Unit", "make_units", "pre_backward", "scale_grads", "gather_full"]


@dataclass
class Unit:
    """One flat parameter of an FSDP instance."""

    op: FSDPUnit
    """The runtime unit: ``op.flat`` is the shard parameter, ``op.full`` the gathered buffer."""
    group: FlatGroup
    """Members, and where each is bound in the user's modules."""
    layout: FlatShard
    """Sharding math: members in flat order, numel, padded size, this rank's index of count."""
    flat_name: str | None
    """Name of the flat parameter on the FlattenParamsWrapper, or None when the parameter keeps its
    own name (``flatten_parameters=False``)."""

    @property
    def flat(self) -> torch.nn.Parameter:
        return self.op.flat

    def shard_range(self) -> tuple[int, int]:
        s = self.layout.shard_numel
        return self.layout.index * s, (self.layout.index + 1) * s


def shard_of(full: torch.Tensor, n: int, rank: int) -> tuple[torch.Tensor, int]:
    """This rank's contiguous 1/n of ``full`` (flattened, zero-padded to a multiple of n), and the padded size."""
    flat = full.reshape(-1)
    padded = -(-flat.numel() // n) * n if flat.numel() else n
    s = padded // n
    out = torch.zeros(s, dtype=flat.dtype, device=flat.device)
    lo, hi = rank * s, min((rank + 1) * s, flat.numel())
    if hi > lo:
        out[:hi - lo].copy_(flat[lo:hi])
    return out, padded


def make_units(groups: Sequence[FlatGroup], fulls: Sequence[torch.Tensor], names: Sequence[str | None],
               fpw: FlattenParamsWrapper, *, n: int, rank: int, axis: str, compute_dtype: torch.dtype | None,
               fp32_reduce_scatter: bool, reshard: bool, compute_device: torch.device,
               shard_device: torch.device) -> list[Unit]:
    """Shard each group's full flat tensor and register the shard parameter where the full one
    was: as ``fpw.<name>`` for flat groups, under the parameter's own slots otherwise.

    ``compute_dtype`` None means compute in the parameters' own dtype (no mixed precision).
    """
    units = []
    for i, (g, full, name) in enumerate(zip(groups, fulls, names)):
        shard, padded = shard_of(full, n, rank)
        if n == 1 and name is None:  # 0.4.13 leaves an unflattened parameter whole, in its shape, at world 1
            shard = shard.view(full.shape)
        compute = compute_dtype or g.dtype
        op = FSDPUnit(index=i, name=name or g.members[0][0], keys=[k for k, _ in g.members],
                      shapes=[s for _, s in g.members], n=n, rank=rank, axis=axis, param_dtype=compute,
                      reduce_dtype=torch.float32 if fp32_reduce_scatter else compute,
                      flat=shard.to(shard_device), reshard=reshard, prefetch=False, offload=False)
        op.flat.requires_grad_(g.requires_grad)
        # FSDPUnit computes where its shard lives unless offloaded to a GPU; ours names the device
        op.compute_device = compute_device
        op.full = torch.empty(padded, dtype=compute, device=compute_device)
        op.full.untyped_storage().resize_(0)
        layout = FlatShard(members=list(g.members), numel=g.numel, padded=padded, index=rank, count=n, axis=axis)
        if name is not None:
            fpw._parameters[name] = op.flat
        else:
            for slots in g.slots:
                for mod, attr in slots:
                    mod._parameters[attr] = op.flat
        units.append(Unit(op=op, group=g, layout=layout, flat_name=name))
    return units


class _PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, units: list[FSDPUnit], free: bool, *xs: torch.Tensor) -> Any:
        ctx.units = units
        if free:
            for u in units:
                u.free()
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        for u in ctx.units:
            u.gather()  # no-op when still gathered from the current shard
        return (None, None) + grads


def pre_backward(units: Sequence[FSDPUnit], free: bool, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Identity on ``tensors`` (a forward's outputs that require grad); frees ``units`` now if
    ``free``; in backward, gathers them again before the forward's own backward ops run."""
    return _PreBackward.apply(list(units), free, *tensors)


class _ScaleGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, factor: float, *xs: torch.Tensor) -> Any:
        ctx.factor = factor
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        return (None,) + tuple(g * ctx.factor if g is not None else None for g in grads)


def scale_grads(tensors: Sequence[torch.Tensor], factor: float) -> tuple[torch.Tensor, ...]:
    """Identity in forward; multiplies the gradients by ``factor`` in backward."""
    return _ScaleGrads.apply(factor, *tensors)


@torch.no_grad()
def gather_full(unit: Unit) -> torch.Tensor:
    """All-gather the unit's shard in its own (master) dtype on the compute device (where the
    backend can communicate: NCCL cannot gather CPU-offloaded shards); returns the padded full flat tensor."""
    flat = unit.flat.detach().to(unit.op.compute_device)
    full = torch.empty(unit.layout.padded, dtype=flat.dtype, device=flat.device)
    comm.all_gather_flat(full, flat, unit.op.axis)
    return full
