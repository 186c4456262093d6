"""Runtime ops that ``shard_data_parallel_pass`` inserts into rank graphs, paired with autograd.

Each op is a plain function the rewritten graph calls, taking a *handle* (an ``nn.Module`` the pass
registers on the GraphModule, reached by a ``get_attr`` node) plus tensors::

    bucket = self.dp_bucket_0
    p = dp_bucket(bucket, shard, w1, w2)        # forward: identity (or cast); backward: all-reduce
                                                 #   (ddp/zero1) or reduce-scatter (zero2) the bucket
    unit = self.fsdp_unit_1
    w = fsdp_unshard(unit, flat)                 # forward: all-gather; backward: reduce-scatter
    h = fsdp_reshard(unit, h1, h2)               # forward: identity + free the gathered storage;
                                                 #   backward: all-gather again before the unit's backward

Reductions are asynchronous, as in PyTorch DDP's reducer: a bucket's backward launches its
all-reduce / reduce-scatter (``async_op=True``) as soon as autograd has every gradient of the
bucket, and returns without waiting, so the collective overlaps the rest of backward; the results
reach ``.grad`` when that backward call finishes (:mod:`passes.ops.grad_sync` says how, and when an
op reduces synchronously instead). FSDP units do the same with their reduce-scatter; a unit's
result lands when the next unit's reduce-scatter starts (at most one unit's full-size gradient
waits in flight, as in PyTorch FSDP2) or at the end of backward.

Devices: everything runs on the device of the graph's parameters, except an offloaded store
(``data_parallel.offload``): master shards and their gradients in host memory. Shards go up with an
asynchronous copy from pinned memory before each gather; gradient shards come down into pinned
memory with a blocking copy (the CPU optimizer reads them next; ``.grad`` may be read by anything).

16-bit casts: a bucket whose parameters are kept in fp32 (ddp, and the replicated parameters of
the sharded kinds) casts them to ``param_dtype`` once and hands every later microbatch views of
the same copies, as long as the parameters are unchanged (their version counters) and at most
until the engine call that made them ends (:func:`release_casts`, called by
``fairscale.runtime.engine``; a ``.data`` write between calls bumps no version). Casting per
microbatch kept one set of copies per microbatch in flight: on a 1F1B pipeline's first stage,
``pp`` times its 16-bit weights. The values, and the gradients flowing back to the fp32
parameters, are the same either way.

Averaging over ``n`` data-parallel ranks is post-division: sum in ``reduce_dtype``, then divide by
``n`` (one rounding in fp32; PyTorch DDP does the same by default).

Gradient accumulation: inside :func:`no_sync` every op adds its local gradient into a full-size
accumulation buffer and returns nothing; the first backward outside ``no_sync`` reduces
``buffer + gradient`` once (PyTorch DDP's ``no_sync`` semantics; for zero2 and fsdp this costs a
full-size buffer for the duration of the accumulation, as PyTorch FSDP's ``no_sync`` does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from passes.ops import comm
from passes.ops.groups import group_function
from passes.ops.gauge import UNSHARD, nbytes
from passes.ops.grad_sync import (async_targets, drop_stale_outside_backward, enqueue, finish_where, flat_grads,
                                  no_sync, pending_reductions, sync_enabled, to_compute, to_store, wait_reductions)

__all__ = ["DDPBucket", "FSDPUnit", "dp_bucket", "fsdp_unshard", "fsdp_reshard", "no_sync", "sync_enabled",
           "pending_reductions", "wait_reductions", "cast_mark", "release_casts"]

# ------------------------------------------------------------------------------------------------
# DDP / ZeRO-1 / ZeRO-2 buckets


class DDPBucket(nn.Module):
    """A gradient bucket of replicated parameters (ddp, zero1, zero2).

    For zero1/zero2 it owns ``shard``: the fp32 master copy of this rank's 1/n slice of the
    bucket's flat parameters, the tensor the sharded optimizer updates.
    """

    def __init__(self, *, kind: str, index: int, keys: list[str], shapes: list[torch.Size], n: int, rank: int,
                 axis: str, param_dtype: torch.dtype, reduce_dtype: torch.dtype, shard: torch.Tensor | None) -> None:
        super().__init__()
        self.kind, self.index, self.keys, self.shapes = kind, index, keys, shapes
        self.n, self.rank, self.axis = n, rank, axis
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.numel = sum(s.numel() for s in shapes)
        # ddp all-reduces the exact bucket; sharded kinds pad to a multiple of n for equal shards
        self.padded = self.numel if kind == "ddp" else -(-self.numel // n) * n
        self.acc: torch.Tensor | None = None
        """Local gradient accumulated under :func:`no_sync` (full size, reduce dtype)."""
        self.shard = nn.Parameter(shard) if shard is not None else None
        self.flat: torch.Tensor | None = None
        """zero1/zero2: replicated flat storage the parameters are views of (set by the pass)."""
        self.params: list[nn.Parameter] = []
        """The bucket's parameters in flat order (set by the pass; a plain list, not registered)."""
        self.casts: tuple[tuple[int, ...], tuple[torch.Tensor, ...]] | None = None
        """(the parameters' versions, their ``param_dtype`` copies) this engine call made (module docstring)."""

    def extra_repr(self) -> str:
        return f"kind={self.kind}, index={self.index}, params={len(self.keys)}, numel={self.numel}, n={self.n}"

    @property
    def shard_range(self) -> tuple[int, int]:
        s = self.padded // self.n
        return self.rank * s, (self.rank + 1) * s

    @torch.no_grad()
    def gather_params(self) -> None:
        """zero1/zero2: all-gather the updated master shards into the replicated parameters."""
        assert self.shard is not None and self.flat is not None
        comm.all_gather_flat(self.flat, to_compute(self.shard, self.flat.device, self.param_dtype), self.axis)


class _Reduction:
    """One bucket's reduction: launched in backward, finished (wait, divide, split) later."""

    def __init__(self, bucket: DDPBucket, flat: torch.Tensor, dtypes: list[torch.dtype]) -> None:
        self.bucket, self.flat, self.dtypes = bucket, flat, dtypes
        self.out: torch.Tensor | None = None
        self.work: Any = None
        self.targets: tuple[torch.Tensor | None, ...] = ()
        """Async only: the leaves (shard, *params) whose ``.grad`` receives the results."""

    def start(self, *, async_op: bool) -> None:
        b = self.bucket
        if b.kind == "zero2":
            lo, hi = b.shard_range
            self.out = torch.empty(hi - lo, dtype=b.reduce_dtype, device=self.flat.device)
            self.work = comm.reduce_scatter_flat(self.out, self.flat, b.axis, async_op=async_op)
        else:
            self.work = comm.all_reduce_(self.flat, b.axis, async_op=async_op)

    @torch.no_grad()
    def finish(self) -> tuple[torch.Tensor | None, ...]:
        """Wait for the collective; return (shard gradient, *parameter gradients), averaged."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        b = self.bucket
        nones = (None,) * len(self.dtypes)
        if b.kind == "zero2":
            assert b.shard is not None and self.out is not None
            return (to_store(self.out.div_(b.n), b.shard),) + nones
        flat = self.flat.div_(b.n)
        param_grads = []
        start = 0
        for shape, dtype in zip(b.shapes, self.dtypes):
            n = shape.numel()
            param_grads.append(flat[start:start + n].view(shape).to(dtype))
            start += n
        lo, hi = b.shard_range
        shard_grad = to_store(flat[lo:hi], b.shard) if b.shard is not None else None
        return (shard_grad, *param_grads)


@group_function
class _Bucket(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, bucket: DDPBucket, shard: torch.Tensor | None, *params: torch.Tensor) -> Any:
        drop_stale_outside_backward()
        ctx.bucket = bucket
        ctx.dtypes = [p.dtype for p in params]
        ctx.device = params[0].device
        ctx.has_shard = shard is not None
        ctx.tensor_inputs = ((shard,) if shard is not None else ()) + params  # leaves: no reference cycle
        if all(p.dtype == bucket.param_dtype for p in params):
            return tuple(p.view_as(p) for p in params)
        return tuple(c.view_as(c) for c in _casts(bucket, params))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        b: DDPBucket = ctx.bucket
        flat = flat_grads(grads, b.shapes, b.padded, b.reduce_dtype, ctx.device)
        nones = (None,) * len(grads)
        if not sync_enabled():
            if b.acc is None and b.kind == "zero2":  # a full gradient a sharded kind would not hold
                UNSHARD.add(nbytes(flat))
            b.acc = flat if b.acc is None else b.acc.add_(flat)
            return (None, None) + nones
        if b.acc is not None:
            flat.add_(b.acc)
            if b.kind == "zero2":
                UNSHARD.sub(nbytes(b.acc))
            b.acc = None
        red = _Reduction(b, flat, ctx.dtypes)
        targets = async_targets(ctx) if comm.group_size(b.axis) > 1 else None
        red.start(async_op=targets is not None)
        if targets is None:
            return (None, *red.finish())
        red.targets = targets if ctx.has_shard else (None, *targets)
        enqueue(red)
        return (None, None) + nones


_CASTING: list[DDPBucket] = []
"""Buckets holding 16-bit casts, until :func:`release_casts`."""


def _casts(bucket: DDPBucket, params: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``params`` in the bucket's ``param_dtype``: the copies made earlier in this engine call while
    the parameters are unchanged, else new ones (module docstring)."""
    versions = tuple(p._version for p in params)
    if bucket.casts is None or bucket.casts[0] != versions:
        if bucket.casts is None:
            _CASTING.append(bucket)
        bucket.casts = versions, tuple(p.to(bucket.param_dtype) for p in params)
    return bucket.casts[1]


def cast_mark() -> int:
    """Where the buckets cast from now on begin: hand it to :func:`release_casts` when the call ends."""
    return len(_CASTING)


def release_casts(mark: int = 0) -> None:
    """Drop the 16-bit copies the buckets made since ``mark`` (:func:`cast_mark`; the autograd graphs
    that saved them keep theirs): the engine calls it when each of its calls ends, so no copy
    outlives the call or a write to the parameters that no version counter sees, and a call nested
    in another (one module's forward inside another's) leaves the outer call's copies alone."""
    while len(_CASTING) > mark:
        _CASTING.pop().casts = None


def dp_bucket(bucket: DDPBucket, shard: torch.Tensor | None, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Identity (or cast to ``param_dtype``) in forward; in backward, reduce the bucket's gradients:
    all-reduce for ddp/zero1 (averaged grads to every parameter, and for zero1 this rank's slice to
    ``shard``), reduce-scatter for zero2 (only the slice, to ``shard``). The collective is launched
    asynchronously and its results land in ``.grad`` when the backward call returns."""
    return _Bucket.apply(bucket, shard, *params)


# ------------------------------------------------------------------------------------------------
# FSDP units


class FSDPUnit(nn.Module):
    """One FSDP unit: ``flat`` holds this rank's 1/n of the unit's flattened, padded parameters
    (fp32 master); ``full`` is the gathered buffer in ``param_dtype`` whose storage is freed
    between uses."""

    def __init__(self, *, index: int, name: str, keys: list[str], shapes: list[torch.Size], n: int, rank: int,
                 axis: str, param_dtype: torch.dtype, reduce_dtype: torch.dtype, flat: torch.Tensor,
                 reshard: bool, prefetch: bool, offload: bool, compute_device: torch.device | None = None,
                 async_reduce: bool = False) -> None:
        super().__init__()
        self.index, self.name, self.keys, self.shapes = index, name, keys, shapes
        self.n, self.rank, self.axis = n, rank, axis
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.reshard, self.prefetch, self.offload = reshard, prefetch, offload
        self.numel = sum(s.numel() for s in shapes)
        self.padded = flat.numel() * n
        self.flat = nn.Parameter(flat)
        self.compute_device = flat.device if compute_device is None else compute_device
        """Where the gathered parameters, activations and gradient collectives live (the shard
        ``flat`` may be elsewhere: offloaded to the host)."""
        self.async_reduce = async_reduce
        """Launch the gradient reduce-scatter without waiting (see the module docstring)."""
        self.full = torch.empty(self.padded, dtype=param_dtype, device=self.compute_device)
        self.full.untyped_storage().resize_(0)
        self.acc: torch.Tensor | None = None
        self.pending: Any = None
        """(Work, shard version) of an in-flight prefetch all-gather."""
        self.gathered_version: int | None = None
        """``flat._version`` the gathered buffer was made from; None when freed."""
        self.holders = 0
        """Recorded forwards whose autograd graph holds views of ``full`` and has not run this unit's
        backward yet (:class:`_Hold`). A unit nothing re-gathers in backward (not resharded after
        forward) is freed only when the last of them is done: a pipeline stage runs F0 F1 B0 B1, and
        microbatch 1's backward still reads the buffer microbatch 0's backward is done with."""
        self.held_version: int | None = None
        """``flat._version`` the holders' views were gathered from."""
        self.next_fwd: FSDPUnit | None = None
        self.prev_bwd: FSDPUnit | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("next_fwd", "prev_bwd"):  # links to sibling units, not child modules (no cycles)
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, params={len(self.keys)}, numel={self.numel}, padded={self.padded}, n={self.n}, "
                f"reshard={self.reshard}")

    @property
    def is_gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def _alloc(self) -> None:
        if not self.is_gathered:
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())
            UNSHARD.add(self.padded * self.full.element_size())

    def free(self) -> None:
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None
        UNSHARD.sub(self.full.untyped_storage().nbytes())
        self.full.untyped_storage().resize_(0)
        self.gathered_version = None

    def _shard_for_comm(self) -> torch.Tensor:
        return to_compute(self.flat, self.compute_device, self.param_dtype)

    def start_gather(self) -> None:
        """Issue an asynchronous all-gather (prefetch) unless the buffer is current or in flight."""
        version = self.flat._version
        if self.pending is not None or (self.is_gathered and self.gathered_version == version):
            return
        self._alloc()
        shard = self._shard_for_comm()
        # .data: collectives write in place; autograd must not see a version bump on saved views
        work = comm.all_gather_flat(self.full.data, shard, self.axis, async_op=True)
        self.pending = (work, version, shard)
        self._overwrote(version)

    def gather(self) -> None:
        """Make ``full`` hold the current parameters (waiting on a prefetch if one is in flight)."""
        version = self.flat._version
        if self.pending is not None:
            work, v, _ = self.pending
            if work is not None:
                work.wait()
            self.pending = None
            self.gathered_version = v
        if self.is_gathered and self.gathered_version == version:
            return
        self._alloc()
        comm.all_gather_flat(self.full.data, self._shard_for_comm(), self.axis)
        self.gathered_version = version
        self._overwrote(version)

    def _overwrote(self, version: int) -> None:
        """The buffer now holds (or is being gathered from) shard version ``version``. If the shard
        changed (an optimizer step) under graphs that still hold views of the old values, the write
        bypassed autograd (``.data``): bump the buffer's version by hand, so a backward of such a
        graph fails as PyTorch's does for a parameter changed in place, instead of silently using
        the new values."""
        if self.holders and self.held_version != version:
            torch.autograd.graph.increment_version(self.full)
            self.held_version = version


class _UnitReduction:
    """One FSDP unit's gradient reduce-scatter: launched in backward, finished (wait, divide, move
    to the shard's device) later."""

    def __init__(self, unit: FSDPUnit, flat: torch.Tensor) -> None:
        self.unit = unit
        self.flat: torch.Tensor | None = flat
        UNSHARD.add(nbytes(flat))
        # the shard's shape: 1-D of padded / n, or a world-1 unit's own parameter shape (classic FSDP)
        self.out = torch.empty(unit.flat.shape, dtype=unit.reduce_dtype, device=unit.compute_device)
        self.work: Any = None
        self.targets: tuple[torch.Tensor | None, ...] = ()

    def start(self, *, async_op: bool) -> None:
        assert self.flat is not None
        self.work = comm.reduce_scatter_flat(self.out, self.flat, self.unit.axis, async_op=async_op)

    @torch.no_grad()
    def finish(self) -> tuple[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        UNSHARD.sub(nbytes(self.flat))
        self.flat = None  # the full-size gradient is free once the collective has read it
        u = self.unit
        return (to_store(self.out.div_(u.n), u.flat),)


class _Hold:
    """One recorded forward's claim on its unit's gathered buffer (:attr:`FSDPUnit.holders`).

    Released by that forward's ``fsdp_unshard`` backward or, for a graph dropped without a backward
    (a loss kept only for logging, a step that raised), when autograd frees the graph and with it
    the ctx that owns this object. Releasing on drop frees nothing: the buffer stays gathered, as
    after any forward without a backward, until the next backward that ends a unit's last hold."""

    __slots__ = ("unit",)

    def __init__(self, unit: FSDPUnit) -> None:
        self.unit: FSDPUnit | None = unit
        if unit.holders == 0:
            unit.held_version = unit.gathered_version
        unit.holders += 1

    def release(self) -> None:
        if self.unit is not None:
            self.unit.holders -= 1
            self.unit = None

    def __del__(self) -> None:
        self.release()


def _finish_units(task: int) -> None:
    """Finish the running backward's unit reductions still in flight (in launch order)."""
    finish_where(task, lambda red: isinstance(red, _UnitReduction))


@group_function
class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, unit: FSDPUnit, flat: torch.Tensor, recorded: bool) -> Any:
        drop_stale_outside_backward()
        ctx.unit = unit
        ctx.tensor_inputs = (flat,)
        unit.gather()
        if recorded:  # a backward may read the views: hold the buffer until it has run
            ctx.hold = _Hold(unit)
        if unit.prefetch and unit.next_fwd is not None:
            unit.next_fwd.start_gather()
        outs, start = [], 0
        for shape in unit.shapes:
            n = shape.numel()
            outs.append(unit.full[start:start + n].view(shape))
            start += n
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        u: FSDPUnit = ctx.unit
        # every backward op of this forward that read the gathered parameters has run: they are
        # freed, and the last unit's reduce-scatter finished (at most one unit's gradient in flight),
        # before this unit's gradient buffer is made; the other order held both, and two gradients,
        # at that moment. A unit that is re-gathered in backward (fsdp_reshard) is freed now; one
        # that is not stays gathered while another forward's graph still holds views of it (the
        # other microbatches of a pipeline step, or of a gradient accumulation)
        ctx.hold.release()
        if u.reshard or u.holders == 0:
            u.free()
        if not sync_enabled():
            flat = flat_grads(grads, u.shapes, u.padded, u.reduce_dtype, u.compute_device)
            if u.acc is None:
                UNSHARD.add(nbytes(flat))
            u.acc = flat if u.acc is None else u.acc.add_(flat)
            return None, None, None
        targets = async_targets(ctx) if u.async_reduce and comm.group_size(u.axis) > 1 else None
        if targets is not None:
            _finish_units(torch._C._current_graph_task_id())
        flat = flat_grads(grads, u.shapes, u.padded, u.reduce_dtype, u.compute_device)
        if u.acc is not None:
            flat.add_(u.acc)
            UNSHARD.sub(nbytes(u.acc))
            u.acc = None
        red = _UnitReduction(u, flat)
        red.start(async_op=targets is not None)
        if targets is None:
            return None, red.finish()[0], None
        red.targets = targets
        enqueue(red)
        return None, None, None


@group_function
class _Reshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, unit: FSDPUnit, *xs: Any) -> Any:
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        unit.free()
        # values of unknown type (graphs without shape meta) may be ints or tuples: pass them through.
        # Aliases by detach(), not views: autograd forbids in-place ops on the views a multi-output
        # Function returns, and the model may update them in place (torchvision's `out += identity`);
        # detach() shares the version counter, so autograd still catches a saved tensor changed in place
        return tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        u: FSDPUnit = ctx.unit
        u.gather()
        if u.prefetch and u.prev_bwd is not None:
            u.prev_bwd.start_gather()
        return (None,) + grads


def fsdp_unshard(unit: FSDPUnit, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """All-gather the unit's flat shard and return its members as views of the gathered buffer
    (in ``param_dtype``); in backward, reduce-scatter their gradients into ``flat``'s gradient."""
    # autograd records the call exactly when grad mode is on and ``flat`` requires grad; only then
    # can a backward read the views, so only then does the forward hold the buffer (not under
    # no_grad / inference_mode: nothing would ever release it)
    return _Unshard.apply(unit, flat, torch.is_grad_enabled() and flat.requires_grad)


def cast_floating(x: Any, dtype: torch.dtype) -> Any:
    """``x.to(dtype)`` if ``x`` is a floating-point tensor, else ``x`` (inputs of unknown dtype)."""
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def float_scalar(x: Any) -> Any:
    """A 0-d floating-point tensor (a loss) in fp32; anything else unchanged."""
    return x.float() if isinstance(x, torch.Tensor) and x.dim() == 0 and x.is_floating_point() else x


def fsdp_reshard(unit: FSDPUnit, *xs: Any) -> tuple[Any, ...]:
    """Identity on the values live after the unit's last use; forward frees the unit's gathered
    storage, backward gathers it again before any of the unit's backward ops runs."""
    return _Reshard.apply(unit, *xs)
