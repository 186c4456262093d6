"""Parameter initialization: every rank starts from exactly the single-process model's weights.

Two ways in:

* **An initialized model** (the usual case). Forked ranks inherit it, so they already agree;
  ranks started by torchrun each built their own copy, so :func:`sync_params` broadcasts rank 0's
  values (what PyTorch DDP does at construction) and :func:`check_replicas` proves agreement.
* **A model built on ``meta`` plus a seed.** :func:`materialize_meta` allocates it and replays the
  initialization that ``torch.manual_seed(seed); Model()`` would have run, giving bit-identical
  values::

      with torch.device("meta"):
          model = Net()
      materialize_meta(model, seed=0)          # == torch.manual_seed(0); Net()

Limits of the replay (it cannot see code, only modules):

* It calls ``reset_parameters()`` of every module that has one, children before parents (the
  order constructors run them: a parent's own reset runs at the end of its ``__init__``). That
  covers models built from ``torch.nn`` layers (Linear, Conv, Embedding, norms, ...).
* Custom initialization inside ``__init__`` (nanoGPT's ``normal_`` on embeddings, Hugging Face's
  ``post_init``) must be passed as ``init_fn(model)``, which runs after the replay on the same RNG
  stream; it is exact when it consumes the RNG as the constructor did.
* Buffers are left as ``to_empty`` made them unless ``init_fn`` fills them (e.g. position ids).
* Every rank materializes the whole model (peak memory = the full model in fp32, once); the
  data-parallel pass then keeps only this rank's shards and the full copy can be dropped.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["materialize_meta", "sync_params", "check_replicas", "ReplicaMismatchError"]


class ReplicaMismatchError(RuntimeError):
    """Ranks hold different initial weights."""


def _post_order(module: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        out.append(m)

    visit(module)
    return out


@torch.no_grad()
def materialize_meta(model: nn.Module, *, seed: int, init_fn: Callable[[nn.Module], None] | None = None,
                     device: str | torch.device = "cpu") -> nn.Module:
    """Allocate ``model``'s meta tensors on ``device`` and initialize them as construction under
    ``torch.manual_seed(seed)`` would have. Returns ``model``. Tied parameters stay tied."""
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise ValueError("materialize_meta expects a model built on the meta device; this one is already "
                         "materialized (pass it as is, or use sync_params to agree across ranks)")
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((m, name))
    model.to_empty(device=device)
    for places in owners.values():  # to_empty may give each owner its own tensor: tie them again
        first_mod, first_name = places[0]
        for m, name in places[1:]:
            setattr(m, name, getattr(first_mod, first_name))
    torch.manual_seed(seed)
    for m in _post_order(model):
        reset = getattr(m, "reset_parameters", None)
        if callable(reset) and any(True for _ in m.parameters(recurse=False)):
            reset()
    if init_fn is not None:
        init_fn(model)
    return model


@torch.no_grad()
def sync_params(module: nn.Module, *, src: int = 0, group: object = None) -> None:
    """Broadcast every parameter and buffer from global rank ``src`` (an initialization step, not
    counted in ``comm.COUNTER``). Collective."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    for t in [*module.parameters(), *module.buffers()]:
        if t.is_floating_point() or t.dtype in (torch.int64, torch.int32, torch.bool):
            dist.broadcast(t.data, src=src, group=group)


@torch.no_grad()
def check_replicas(module: nn.Module, *, group: object = None) -> None:
    """Raise :class:`ReplicaMismatchError` if ranks hold different parameters. Collective."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    names, sums = [], []
    for name, p in module.named_parameters():
        names.append(name)
        flat = p.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)  # order-sensitive checksum
        sums.append(torch.stack([flat.sum(), (flat * weights).sum()]))
    local = torch.stack(sums) if sums else torch.zeros(0, 2, dtype=torch.float64)
    lo, hi = local.clone(), local.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    bad = [names[i] for i in range(len(names)) if not torch.equal(lo[i], hi[i])]
    if bad:
        raise ReplicaMismatchError(
            f"ranks start from different weights for {len(bad)} parameter(s), e.g. {bad[:3]}; seed every rank "
            "the same before building the model, or call fairscale.runtime.init.sync_params(model) "
            "(DataParallelRunner.build(..., sync=True)) to copy rank 0's weights")
