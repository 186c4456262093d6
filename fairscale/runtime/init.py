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
* :func:`materialize_meta` builds the whole model on every rank (peak = the full model once).
  :func:`materialize_sharded` streams instead: capture the meta model, run the data-parallel pass
  (whose shards then hold uninitialized memory), and replay module by module, copying each freshly
  initialized module's parameters into this rank's shards and dropping them (peak = the largest
  module). It needs ``reset_parameters`` to touch only the module's own parameters (true of torch.nn
  layers except ``nn.MultiheadAttention``, whose reset reaches into its ``out_proj`` child) and takes
  custom initialization as ``param_init(key, tensor) -> bool`` applied per parameter in
  ``named_parameters`` order; buffers must not be on meta.
"""

from __future__ import annotations

from typing import Callable

import torch.fx

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["materialize_meta", "materialize_sharded", "sync_params", "check_replicas", "ReplicaMismatchError"]


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


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """[sum, position-weighted sum] of ``t``'s bit patterns as int64 (wrapping): exact, so equal
    tensors give equal fingerprints on any hardware, and cheap (a chunk at a time, no float
    rounding, no copy of the whole tensor)."""
    flat = t.detach().reshape(-1)
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.view(_BITS[flat.element_size()]) if flat.element_size() in _BITS else flat.view(torch.uint8)
    out = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK].to(torch.int64)
        weights = torch.arange(start + 1, start + part.numel() + 1, dtype=torch.int64, device=flat.device)
        out += torch.stack([part.sum(), (part * weights).sum()])
    return out


@torch.no_grad()
def check_replicas(module: nn.Module, *, group: object = None, device: torch.device | str | None = None) -> None:
    """Raise :class:`ReplicaMismatchError` if ranks hold different parameters. Collective: one
    all-reduce of two integers per parameter (on ``device``: the process group's device, CUDA
    under NCCL), whatever device the parameters are on."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    if device is None:
        from fairscale.runtime.device import collective_device

        device = collective_device()
    names, prints = [], []
    for name, p in module.named_parameters():
        names.append(name)
        prints.append(_fingerprint(p))
    local = torch.stack(prints).to(device) if prints else torch.zeros(0, 2, dtype=torch.int64, device=device)
    both = torch.cat([local, -local], dim=1)  # max of (x, -x) gives max and -min in one all-reduce
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    hi, lo = both[:, :2], -both[:, 2:]
    bad = [names[i] for i in range(len(names)) if not torch.equal(lo[i], hi[i])]
    if bad:
        raise ReplicaMismatchError(
            f"ranks start from different weights for {len(bad)} parameter(s), e.g. {bad[:3]}. Every rank builds "
            "its own model under torchrun: seed every rank the same (torch.manual_seed(0)) before building it, "
            "or load the same weights on every rank; for the data-parallel runner, "
            "DataParallelRunner.build(..., sync=True) copies rank 0's weights (fairscale.runtime.init.sync_params)")


def _locations(gm: torch.fx.GraphModule) -> dict[str, list[Callable[[torch.Tensor], None]]]:
    """user key -> writers that copy a full tensor into this rank's storage for that key."""
    from passes.dp.info import dp_info
    from passes.layout import layout_of
    from planner.modpath import fetch_attr

    layout, info = layout_of(gm), dp_info(gm)
    out: dict[str, list[Callable[[torch.Tensor], None]]] = {}

    def add(key: str, fn: Callable[[torch.Tensor], None]) -> None:
        out.setdefault(key, []).append(fn)
        for alias in info.aliases.get(key, []):
            out.setdefault(alias, []).append(fn)

    def into_range(dst: torch.Tensor, lo: int, start: int) -> Callable[[torch.Tensor], None]:
        def write(full: torch.Tensor) -> None:  # elements [start, start+n) of the flat, clipped to dst
            flat = full.reshape(-1)
            a, b = max(start, lo), min(start + flat.numel(), lo + dst.numel())
            if a < b:
                dst[a - lo:b - lo] = flat[a - start:b - start]
        return write

    for attr, key in layout.keys.items():
        try:
            t = fetch_attr(gm, attr)
        except AttributeError:
            continue
        if isinstance(t, torch.Tensor):
            add(key, lambda full, t=t: t.data.copy_(full))
    for b in info.buckets:
        start = 0
        for key, shape in zip(b.keys, b.shapes):
            if b.shard is not None:
                add(key, into_range(b.shard.data, b.shard_range[0], start))
            start += shape.numel()
    for u in info.units:
        start = 0
        for key, shape in zip(u.keys, u.shapes):
            add(key, into_range(u.flat.data, u.rank * u.flat.numel(), start))
            start += shape.numel()
    return out


@torch.no_grad()
def materialize_sharded(gm: torch.fx.GraphModule, meta_model: nn.Module, *, seed: int,
                        param_init: Callable[[str, torch.Tensor], bool] | None = None) -> None:
    """Fill the data-parallel rank graph ``gm`` (built from a capture of ``meta_model``) with the
    values ``torch.manual_seed(seed); Model()`` gives, one module at a time (see the module
    docstring). ``meta_model`` stays on meta."""
    where = _locations(gm)
    names = {id(m): n for n, m in meta_model.named_modules()}
    torch.manual_seed(seed)
    for m in _post_order(meta_model):
        own = list(m.named_parameters(recurse=False))
        reset = getattr(m, "reset_parameters", None)
        if not own or not callable(reset):
            continue
        m.to_empty(device="cpu", recurse=False)
        reset()
        prefix = names[id(m)]
        for name, p in m.named_parameters(recurse=False):
            for write in where.get(f"{prefix}.{name}" if prefix else name, []):
                write(p)
        m.to_empty(device="meta", recurse=False)
    if param_init is not None:
        for key, p in meta_model.named_parameters():
            # lint: cpu -- built whole on the host, then copied into this rank's shards on its device
            full = torch.empty(p.shape, dtype=p.dtype, device="cpu")
            if param_init(key, full):
                for write in where.get(key, []):
                    write(full)
    from passes.dp.info import dp_info

    info = dp_info(gm)
    for b in info.buckets:  # zero kinds: replicas from the filled master shards
        if b.shard is not None:
            b.gather_params()
    for u in info.units:
        u.free()
    stale = [n for n, t in [*gm.named_parameters(), *gm.named_buffers()] if t.is_meta]
    if stale:
        raise ValueError(f"{stale[:3]} are still on meta after materialization: buffers created in __init__ "
                         "cannot be replayed; build the model on CPU and use sync_params instead")
