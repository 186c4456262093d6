"""Optimizers for data-parallel rank graphs: any ``torch.optim`` optimizer over the local shards.

Usage::

    opt = DataParallelOptimizer(rank_gm, torch.optim.AdamW, lr=1e-3)
    loss = rank_gm(*batch); loss.backward()
    opt.clip_grad_norm_(1.0)          # global norm across every shard
    opt.step(); opt.zero_grad(set_to_none=True)

What the wrapped optimizer sees, per kind:

* ddp: the replicated parameters (it is the user's optimizer, unchanged);
* zero1/zero2: one fp32 master shard per gradient bucket (1/n of the bucket, ZeRO "P_os"); after
  ``step`` the updated shards are all-gathered into the replicated parameters;
* fsdp: one fp32 flat shard per unit (1/n of the unit); no communication at step time.

Elementwise optimizers (SGD, Adam, AdamW, Adagrad, RMSprop ...) give exactly the single-process
update on any shard. Optimizers that look across a whole tensor (LAMB/LARS trust ratios, Adafactor's
factored moments, Shampoo) would see flat shards instead and are refused for sharded kinds.

``zero_grad(set_to_none=True)`` is safe: the rank graph returns every gradient through autograd,
which assigns a fresh ``.grad`` when it is None (FairScale 0.4's ShardedDataParallel wrote into
cached gradient buffers and silently lost gradients after ``set_to_none``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.fx

from passes import comm
from passes.shard_data_parallel import META_DP, DataParallelInfo

__all__ = ["DataParallelOptimizer", "ELEMENTWISE"]

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "ASGD", "Rprop")
"""torch.optim classes whose update of an element depends only on that element's history."""


def dp_info(gm: torch.fx.GraphModule) -> DataParallelInfo:
    info = gm.meta.get(META_DP)
    if info is None:
        raise ValueError("this GraphModule has no data-parallel record (gm.meta['fs_dp']); run "
                         "passes.shard_data_parallel.shard_data_parallel_pass on it first")
    return info


class DataParallelOptimizer:
    """Wrap ``optimizer_cls`` (any torch.optim optimizer) around the tensors this rank updates."""

    def __init__(self, gm: torch.fx.GraphModule, optimizer_cls: Callable[..., torch.optim.Optimizer],
                 **kwargs: Any) -> None:
        self.gm = gm
        self.info = dp_info(gm)
        kind = self.info.kind
        if kind != "ddp" and getattr(optimizer_cls, "__name__", "") not in ELEMENTWISE \
                and not kwargs.pop("allow_non_elementwise", False):
            raise ValueError(
                f"{getattr(optimizer_cls, '__name__', optimizer_cls)} may not be elementwise; kind={kind!r} shards "
                f"flattened parameters, so it would see shards instead of whole tensors. Use one of {ELEMENTWISE}, "
                "use kind='ddp', or pass allow_non_elementwise=True if its update is elementwise")
        self.params = self._params()
        self.optimizer = optimizer_cls(self.params, **kwargs)

    def _params(self) -> list[torch.nn.Parameter]:
        if self.info.kind == "ddp":
            return [p for p in self.gm.parameters() if p.requires_grad]
        return self.info.sharded_params() + self.info.plain_params()

    # -- the torch.optim surface ------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        out = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        for bucket in self.info.buckets:
            if bucket.shard is not None:
                bucket.gather_params()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.gm.parameters():  # zero1 also holds full averaged grads on the replicas
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (over its local tensors); see ``fairscale.runtime.state``
        for the state in the user's parameter keys."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    # -- clipping ---------------------------------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, reduce_axes: Iterable[str] = ()) -> torch.Tensor:
        """Scale gradients so their global ``norm_type`` norm is at most ``max_norm``; return the
        norm before clipping (``torch.nn.utils.clip_grad_norm_`` semantics, same 1e-6 epsilon).

        Sharded kinds sum the shards' partial norms over the dp axis (padding is zero and adds
        nothing). ``reduce_axes`` names further axes whose ranks hold disjoint parameters (``pp``).
        """
        grads = [p.grad for p in self.params if p.grad is not None]
        sharded_ids = {id(p) for p in self.info.sharded_params()}
        # shards hold disjoint pieces (their partial norms add over dp); whole parameters are replicas
        parts = ([p.grad for p in self.params if p.grad is not None and id(p) in sharded_ids],
                 [p.grad for p in self.params if p.grad is not None and id(p) not in sharded_ids])
        acc = torch.promote_types(grads[0].dtype, torch.float32) if grads else torch.float32
        device = grads[0].device if grads else torch.device("cpu")
        inf = math.isinf(norm_type)
        totals = []
        for gs, axes in zip(parts, (list(reduce_axes) + [self.info.axis], list(reduce_axes))):
            if not gs and self.info.kind == "ddp":  # every rank agrees: ddp has no shards to reduce
                totals.append(torch.zeros((), dtype=acc, device=device))
                continue
            if inf:
                t = max((g.detach().abs().max().to(acc) for g in gs), default=torch.zeros((), dtype=acc, device=device))
            else:
                t = sum((g.detach().to(acc).norm(norm_type) ** norm_type for g in gs),
                        torch.zeros((), dtype=acc, device=device))
            t = t.clone().reshape(1)
            for axis in axes:
                if comm.group_size(axis) > 1:
                    dist.all_reduce(t, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=comm.get_group(axis))
            totals.append(t[0])
        total = torch.maximum(*totals) if inf else (totals[0] + totals[1]) ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        if self.info.kind == "zero1":  # keep the replicas' full gradients consistent with the shards
            for p in self.gm.parameters():
                if p.grad is not None and p.requires_grad and not any(p is q for q in self.params):
                    p.grad.mul_(coef.to(p.grad.dtype))
        return total
