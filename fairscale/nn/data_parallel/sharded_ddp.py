"""ShardedDataParallel: ZeRO stage 2 (sharded gradients) over :class:`fairscale.optim.OSS`.

Each gradient is *reduced* to the rank that owns its optimizer shard, not all-reduced; the other
ranks drop it. Rajbhandari et al. 2020, "ZeRO", section 5.2 (P_os+g)::

    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)
    model = ShardedDataParallel(model, optimizer)
    for batch in loader:
        optimizer.zero_grad(set_to_none=True)
        model(batch).sum().backward()
        optimizer.step()

How the reduction works (and why ``zero_grad(set_to_none=True)`` is safe here): a hook on each
parameter's gradient accumulator marks it ready. A gradient of at least ``reduce_buffer_size / 4``
elements is reduced on its own, *in place* in ``param.grad``: no copy in or out (on CPU the copies
of a bucket cost a fifth of a step's compute thread). Smaller gradients are grouped into buckets
per owner rank (at most ``reduce_buffer_size`` elements each) and *copied* into a fresh flat buffer.
Buckets are launched asynchronously in one fixed order, that of their last gradient in a
reverse-registration-order backward, as soon as they and every earlier one are ready: every rank
issues the same collectives in the same order, and a bucket of small gradients spread over the
model does not hold back the large ones behind it. At the end of backward, remaining buckets
(parameters that got no gradient on this rank) are launched in the same order with zeros. The
owner then holds the averaged result in ``param.grad``. On the other ranks, as in FairScale 0.4.13:
a gradient reduced on its own is dropped (``param.grad = None``: the reduction used its memory), a
bucketed one keeps this rank's contribution to the average (its local gradient / world size; 0.4.13
left the bucket's partially reduced values there). Only the owner's gradient is the step's gradient:
clip with ``OSS.clip_grad_norm``, which reads owned gradients only.
A "had a gradient" flag per parameter (inside its bucket; for in-place gradients, in one small
all-reduce at the end of backward) keeps ``grad = None`` for a parameter that no rank used (as in
single-process training). No gradient ever aliases a long-lived buffer, so replacing
``param.grad`` between steps cannot leave a stale view behind (FairScale 0.4.13 kept ``.grad`` as
views into its buckets and reduced stale data after ``set_to_none``).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Any, Generator

import torch
import torch.distributed as dist
from torch import nn

from fairscale.optim.oss import OSS, collective_device
from passes.ops import comm

__all__ = ["ShardedDataParallel"]


def reduce_(t: torch.Tensor, axis: str, *, dst_rank: int, async_op: bool = False) -> Any:
    """Sum ``t`` over ``axis`` into axis-local rank ``dst_rank``.

    Counted as ``B`` wire bytes per rank: a pipelined chain reduce forwards each rank's partial sum
    once (Thakur et al. 2005, section 4), the same volume the counter gives a broadcast.
    """
    n = comm.group_size(axis)
    if n == 1:
        return None
    group = comm.get_group(axis)
    nbytes = t.numel() * t.element_size()
    comm.count("reduce", axis, nbytes, float(nbytes))
    return dist.reduce(t, dst=dist.get_global_rank(group, dst_rank), group=group, async_op=async_op)


def _weak_grad_ready(ref: Any, p: torch.Tensor) -> None:
    """The gradient hook: ``ShardedDataParallel._grad_ready`` of the wrapper ``ref`` still points to."""
    sdp = ref()
    if sdp is not None:
        sdp._grad_ready(p)


class _Bucket:
    __slots__ = ("owner", "params", "ready", "work", "flat", "direct", "had_grad")

    def __init__(self, owner: int, params: list[torch.Tensor], *, direct: bool = False) -> None:
        self.owner = owner
        self.params = params
        self.ready = 0
        self.work: Any = None
        self.flat: torch.Tensor | None = None
        self.direct = direct  # one parameter, reduced in place in its own gradient
        self.had_grad = False


class ShardedDataParallel(nn.Module):
    """Wrap ``module`` for sharded data parallelism with one or more :class:`OSS` optimizers.

    Args:
        module: the model (same on every rank; see ``sync_models_at_startup``).
        sharded_optimizer: an ``OSS`` instance, or a list of them, covering the trainable parameters.
        process_group: the data-parallel group; must be the optimizers' group (default: world).
        broadcast_buffers: broadcast module buffers (BatchNorm statistics) from rank 0 before
            every forward in training mode.
        sync_models_at_startup: broadcast parameters and buffers from rank 0 at construction.
        reduce_buffer_size: elements per gradient bucket (as in FairScale 0.4.13); a gradient of at
            least a quarter of it is reduced on its own, in place; 0 reduces each gradient on its own.
        auto_refresh_trainable: when parameters change ``requires_grad``, rebuild the hooks and
            buckets at the next forward (otherwise warn once and keep the old set).
        reduce_fp16: reduce fp32 gradients as fp16 (halves traffic, rounds the gradients).
    """

    def __init__(self, module: nn.Module, sharded_optimizer: OSS | list[OSS], process_group: Any = None,
                 broadcast_buffers: bool = True, sync_models_at_startup: bool = True,
                 reduce_buffer_size: int = 2**23, auto_refresh_trainable: bool = True,
                 reduce_fp16: bool = False, warn_on_trainable_params_changed: bool = True) -> None:
        super().__init__()
        self.module = module
        self.sharded_optimizers: list[OSS] = (list(sharded_optimizer) if isinstance(sharded_optimizer, (list, tuple))
                                              else [sharded_optimizer])
        for opt in self.sharded_optimizers:
            if not isinstance(opt, OSS):
                raise TypeError(f"ShardedDataParallel needs fairscale.optim.OSS optimizers, got {type(opt).__name__}; "
                                "wrap your optimizer class: OSS(params, optim=torch.optim.Adam, lr=...)")
        self.process_group = dist.group.WORLD if process_group is None else process_group
        for opt in self.sharded_optimizers:
            if dist.get_process_group_ranks(opt.group) != dist.get_process_group_ranks(self.process_group):
                raise ValueError("ShardedDataParallel's process_group must be the group its OSS optimizers "
                                 "shard over; pass the same group to both")
        self.axis = self.sharded_optimizers[0].axis
        devices = {p.device for p in module.parameters()}
        self.is_multi_device_module = len(devices) > 1
        types = {d.type for d in devices}
        if len(types) > 1:
            raise ValueError(f"ShardedDataParallel needs the module's parameters on one type of device, found "
                             f"{sorted(types)}; move the module first")
        self.device_type = types.pop() if types else "cpu"
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        if reduce_buffer_size < 0:
            raise ValueError(f"reduce_buffer_size must be >= 0 bytes, got {reduce_buffer_size}")
        self.broadcast_buffers = broadcast_buffers
        self.reduce_buffer_size = int(reduce_buffer_size)
        self.auto_refresh_trainable = auto_refresh_trainable
        self.reduce_fp16 = reduce_fp16
        self._warn_on_change = warn_on_trainable_params_changed
        self._warned_change = False
        self.should_accumulate_grads = False
        self._hooks: list[Any] = []
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[torch.Tensor, _Bucket] = {}
        self._next_launch = 0
        self._callback_queued = False
        self._trainable: list[torch.Tensor] = []
        self._owner: dict[torch.Tensor, int] = {}
        if sync_models_at_startup:
            self.sync_parameters()
            self.sync_buffers()
        self.refresh_trainable()

    # -------------------------------------------------------------------------------- setup

    def _current_trainable(self) -> list[torch.Tensor]:
        seen: set[int] = set()
        out: list[torch.Tensor] = []
        for p in self.module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def refresh_trainable(self) -> None:
        """Re-read which parameters are trainable and rebuild the gradient hooks and buckets."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for opt in self.sharded_optimizers:
            opt.refresh_trainable()
        self._trainable = self._current_trainable()
        self._owner = {}
        for opt in self.sharded_optimizers:
            self._owner.update(opt.param_to_rank)
        missing = [p for p in self._trainable if p not in self._owner]
        if missing:
            names = {id(p): n for n, p in self.module.named_parameters()}
            raise ValueError(f"trainable parameters not handled by any OSS optimizer: "
                             f"{[names.get(id(p), '?') for p in missing][:5]}; pass them to an OSS optimizer "
                             "or set requires_grad=False")
        self._buckets = self._make_buckets()
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        for p in self._trainable:
            # through a weak reference: a bound method would make a cycle through C++ hook storage
            # (param -> hook -> self -> module -> param) that gc cannot see, pinning the process
            # group and its gloo threads until interpreter exit
            ready = functools.partial(_weak_grad_ready, weakref.ref(self))
            self._hooks.append(p.register_post_accumulate_grad_hook(ready))

    def _make_buckets(self) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        open_by_owner: dict[tuple[int, torch.dtype, torch.device], tuple[_Bucket, int]] = {}
        backward_order = list(reversed(self._trainable))
        for p in backward_order:
            owner = self._owner[p]
            numel = p.numel()
            if numel >= self.reduce_buffer_size // 4 and not self._casts(p):
                buckets.append(_Bucket(owner, [p], direct=True))
                continue
            key = (owner, p.dtype, p.device)
            cur = open_by_owner.get(key)
            if cur is not None and cur[1] + numel <= self.reduce_buffer_size:
                cur[0].params.append(p)
                open_by_owner[key] = (cur[0], cur[1] + numel)
                continue
            b = _Bucket(owner, [p])
            buckets.append(b)
            open_by_owner[key] = (b, numel)
        position = {p: i for i, p in enumerate(backward_order)}
        buckets.sort(key=lambda b: position[b.params[-1]])  # stable: ties keep creation order
        return buckets

    def _casts(self, p: torch.Tensor) -> bool:
        return self.reduce_fp16 and p.dtype == torch.float32

    def sync_parameters(self) -> None:
        """Broadcast all parameters from rank 0 of the group."""
        with torch.no_grad():
            for p in self.module.parameters():
                comm.broadcast_(p.data, self.axis, src_rank=0)

    def sync_buffers(self, blocking: bool = True) -> None:
        """Broadcast all buffers from rank 0 of the group (always blocking on gloo)."""
        with torch.no_grad():
            for b in self.module.buffers():
                comm.broadcast_(b.data, self.axis, src_rank=0)

    # -------------------------------------------------------------------------------- forward

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.training and any(p.grad is not None and p.grad.requires_grad for p in self._trainable):
            raise RuntimeError("ShardedDataParallel only works with gradients that don't require grad: a "
                               "parameter's .grad is part of an autograd graph (left by backward(create_graph=True)?); "
                               "zero_grad(set_to_none=True) or detach it first")
        if [id(p) for p in self._current_trainable()] != [id(p) for p in self._trainable]:
            if self.auto_refresh_trainable:
                self.refresh_trainable()
            elif self._warn_on_change and not self._warned_change:
                self._warned_change = True
                warnings.warn("ShardedDataParallel: the set of trainable parameters changed and "
                              "auto_refresh_trainable=False; call refresh_trainable() or the new "
                              "parameters get no reduced gradient")
        if self.broadcast_buffers and self.training and self.world_size > 1:
            self.sync_buffers()
        self._reset_buckets()
        return self.module(*inputs, **kwargs)

    def _reset_buckets(self) -> None:
        for b in self._buckets:
            b.ready, b.work, b.flat = 0, None, None
        self._next_launch = 0
        self._callback_queued = False

    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally (no communication) inside this context."""
        old = self.should_accumulate_grads
        self.should_accumulate_grads = True
        try:
            yield
        finally:
            self.should_accumulate_grads = old

    # -------------------------------------------------------------------------------- reduction

    def _grad_ready(self, p: torch.Tensor) -> None:
        if p.grad is not None and p.grad.requires_grad:
            raise RuntimeError("ShardedDataParallel only works with gradients that don't require grad "
                               "(backward(create_graph=True) / grad-of-grad is not supported)")
        if self.should_accumulate_grads or self.world_size == 1:
            return
        b = self._bucket_of.get(p)
        if b is None:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        b.ready += 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next_launch < len(self._buckets):
            b = self._buckets[self._next_launch]
            if not force and b.ready < len(b.params):
                return
            self._launch(b)
            self._next_launch += 1

    def _launch(self, b: _Bucket) -> None:
        if b.direct:
            p = b.params[0]
            b.had_grad = p.grad is not None
            g = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
            b.flat = g if g.is_contiguous() else g.contiguous()  # in place unless non-contiguous
            b.work = reduce_(b.flat, self.axis, dst_rank=b.owner, async_op=True)
            return
        dtype = torch.float16 if self._casts(b.params[0]) else b.params[0].dtype
        parts = [(p.grad.detach() if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype)
                 for p in b.params]
        # one "had a gradient" flag per parameter rides along: a parameter no rank used keeps
        # grad None on its owner, as in single-process training (not a zero gradient)
        parts.append(torch.tensor([float(p.grad is not None) for p in b.params], dtype=dtype,
                                  device=b.params[0].device))
        b.flat = torch.cat(parts)
        b.work = reduce_(b.flat, self.axis, dst_rank=b.owner, async_op=True)

    def _finish_backward(self) -> None:
        self._launch_ready(force=True)
        direct = [b for b in self._buckets if b.direct]
        flags, flags_work = None, None
        if direct:  # did any rank have each in-place gradient; queued behind the reductions
            flags = torch.tensor([float(b.had_grad) for b in direct], device=collective_device(self.axis))
            flags_work = comm.all_reduce_(flags, self.axis, async_op=True)
        with torch.no_grad():
            for b in self._buckets:
                if b.work is not None:
                    b.work.wait()
            if flags_work is not None:
                flags_work.wait()
            used = {id(b): u for b, u in zip(direct, (flags > 0).tolist())} if flags is not None else {}
            for b in self._buckets:
                if b.owner != self.rank:
                    for p in b.params:
                        if b.direct or p.grad is None:
                            p.grad = None  # its memory held the (in-place) reduction
                        else:
                            p.grad.div_(self.world_size)  # this rank's contribution to the average
                elif b.direct:
                    self._finish_direct(b, used[id(b)])
                else:
                    self._finish_bucket(b)
                b.flat, b.work = None, None
        self._reset_buckets()

    def _finish_direct(self, b: _Bucket, used: bool) -> None:
        p, flat = b.params[0], b.flat
        assert flat is not None
        if not p.requires_grad or not used:  # frozen, or used by no rank: no gradient
            p.grad = None
            return
        flat.div_(self.world_size)
        if p.grad is None or p.grad.data_ptr() != flat.data_ptr():
            p.grad = flat.view_as(p)  # this step's zeros (no gradient on this rank) or contiguous copy

    def _finish_bucket(self, b: _Bucket) -> None:
        assert b.flat is not None
        used = b.flat[-len(b.params):] > 0
        b.flat.div_(self.world_size)
        offset = 0
        for p, had_grad in zip(b.params, used.tolist()):
            n = p.numel()
            g = b.flat[offset:offset + n].view_as(p).to(p.dtype)
            offset += n
            if not p.requires_grad or not had_grad:  # frozen, or used by no rank: no gradient
                p.grad = None
                continue
            if p.grad is None:
                p.grad = g  # a view of this step's fresh buffer, never reused
            else:
                p.grad.copy_(g)

    def reduce(self) -> None:
        """Reduce the current gradients now (for gradients produced outside a wrapped forward/backward)."""
        if self.world_size == 1:
            return
        self._reset_buckets()
        self._finish_backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) every parameter's gradient."""
        for p in self.module.parameters():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)
