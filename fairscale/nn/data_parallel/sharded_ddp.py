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
parameter's gradient accumulator marks it ready; parameters are grouped into buckets per owner
rank (at most ``reduce_buffer_size`` bytes each, in reverse registration order, i.e. roughly the
order backward produces them). When every gradient of a bucket is ready, and every earlier bucket
was launched, the bucket is *copied* into a fresh flat buffer and reduced asynchronously. At the end
of backward, remaining buckets (parameters that got no gradient on this rank) are launched in
the same order with zeros, so every rank issues the same collectives in the same order. The owner
then writes the averaged result into ``param.grad``; other ranks set ``param.grad = None``.
Each bucket also carries one flag per parameter saying whether this rank produced a gradient
for it, so a parameter that no rank used keeps ``grad = None`` (as in single-process training).
No gradient ever aliases a long-lived bucket buffer, so replacing ``param.grad`` between steps
cannot leave a stale view behind (FairScale 0.4.13 kept ``.grad`` as views into its buckets and
reduced stale data after ``set_to_none``).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Generator

import torch
import torch.distributed as dist
from torch import nn

from fairscale.optim.oss import OSS
from passes import comm

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
    comm.COUNTER.record("reduce", axis, nbytes, float(nbytes))
    return dist.reduce(t, dst=dist.get_global_rank(group, dst_rank), group=group, async_op=async_op)


class _Bucket:
    __slots__ = ("owner", "params", "ready", "work", "flat")

    def __init__(self, owner: int, params: list[torch.Tensor]) -> None:
        self.owner = owner
        self.params = params
        self.ready = 0
        self.work: Any = None
        self.flat: torch.Tensor | None = None


class ShardedDataParallel(nn.Module):
    """Wrap ``module`` for sharded data parallelism with one or more :class:`OSS` optimizers.

    Args:
        module: the model (same on every rank; see ``sync_models_at_startup``).
        sharded_optimizer: an ``OSS`` instance, or a list of them, covering the trainable parameters.
        process_group: the data-parallel group; must be the optimizers' group (default: world).
        broadcast_buffers: broadcast module buffers (BatchNorm statistics) from rank 0 before
            every forward in training mode.
        sync_models_at_startup: broadcast parameters and buffers from rank 0 at construction.
        reduce_buffer_size: bytes per gradient bucket; 0 reduces each gradient on its own.
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
            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def _make_buckets(self) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        open_by_owner: dict[tuple[int, torch.dtype, torch.device], tuple[_Bucket, int]] = {}
        for p in reversed(self._trainable):
            owner = self._owner[p]
            nbytes = p.numel() * p.element_size()
            key = (owner, p.dtype, p.device)
            cur = open_by_owner.get(key)
            if cur is not None and cur[1] + nbytes <= self.reduce_buffer_size:
                cur[0].params.append(p)
                open_by_owner[key] = (cur[0], cur[1] + nbytes)
                continue
            b = _Bucket(owner, [p])
            buckets.append(b)
            open_by_owner[key] = (b, nbytes)
        return buckets

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
        dtype = torch.float16 if self.reduce_fp16 and b.params[0].dtype == torch.float32 else b.params[0].dtype
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
        with torch.no_grad():
            for b in self._buckets:
                if b.work is not None:
                    b.work.wait()
                if b.owner != self.rank:
                    for p in b.params:
                        p.grad = None
                    continue
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
                b.flat, b.work = None, None
        self._reset_buckets()

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
