"""Run-time helpers of data parallelism: a rank's slice of the global batch, and the bytes a
data-parallel rank graph holds (``fairscale.data_parallel.DataParallelRunner.memory``)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from fairscale.runtime.optim import DataParallelOptimizer
from passes.dp.info import dp_info

__all__ = ["local_slice", "memory_bytes"]


def local_slice(batch: Sequence[Any], index: int, count: int) -> tuple[Any, ...]:
    """This rank's contiguous slice (dim 0) of every tensor in ``batch``."""
    out = []
    for t in batch:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            if t.shape[0] % count:
                raise ValueError(f"the global batch has {t.shape[0]} rows, which does not divide over "
                                 f"{count} data-parallel ranks; use a batch size that is a multiple of {count}")
            per = t.shape[0] // count
            out.append(t[index * per:(index + 1) * per])
        else:
            out.append(t)
    return tuple(out)


def rank_slice(batch: Sequence[Any], index: int, count: int) -> tuple[Any, ...]:
    """:func:`local_slice` of the batch a ParallelModule runs, refusing inputs that want a gradient
    where the batch is cut: each dp rank's loss is its own slice's mean, so the gradient reaching an
    input (a gradient penalty's ``x.requires_grad_()``, or a tensor computed by trainable modules
    outside the model) would be this rank's rows only, ``count`` times one process's, silently."""
    if count > 1 and torch.is_grad_enabled():
        wanting = [i for i, t in enumerate(batch) if isinstance(t, torch.Tensor) and t.requires_grad]
        if wanting:
            raise ValueError(
                f"batch input {wanting[0]} requires a gradient, but this plan cuts the batch over {count} data-parallel "
                "ranks, each computing the mean loss of its own rows: the gradient reaching that input (torch.autograd"
                ".grad(loss, x), a gradient penalty, or the modules outside the model that computed it) would hold "
                f"this rank's rows only, {count} times one process's. Compute what needs it inside the model's "
                "forward, pass the input detached (x.detach()), or use a plan with mesh.dp = 1")
    return local_slice(batch, index, count)


def memory_bytes(gm: torch.fx.GraphModule, optimizer: DataParallelOptimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds for parameters (incl. fp32 master shards and gathered FSDP buffers
    still allocated), gradients, and per-element optimizer states (scalar step counters excluded)."""
    info = dp_info(gm)
    seen: set[int] = set()
    params = grads = 0
    for p in gm.parameters():
        storage = p.untyped_storage()
        if storage.data_ptr() not in seen or storage.nbytes() == 0:
            seen.add(storage.data_ptr())
            params += storage.nbytes()
        if p.grad is not None:
            grads += p.grad.numel() * p.grad.element_size()
    for u in info.units:
        params += u.full.untyped_storage().nbytes()
    for b in info.buckets:
        if b.flat is not None and b.flat.untyped_storage().data_ptr() not in seen:
            params += b.flat.untyped_storage().nbytes()
    for holder in [*info.units, *info.buckets]:
        if holder.acc is not None:
            grads += holder.acc.numel() * holder.acc.element_size()
    states = 0
    if optimizer is not None:
        for st in optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:  # per-element state, not step counters
                    states += v.numel() * v.element_size()
    return {"params": params, "grads": grads, "optimizer": states}
