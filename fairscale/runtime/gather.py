"""Full tensors onto global rank 0 (``pm.state_dict``, ``pm.full_grads``), and the trained weights
back into the user's model on every rank (``pm.gather_into``, :mod:`fairscale.runtime.model_guard`)."""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from fairscale.runtime.mesh import RankMesh
from fairscale.runtime.model_guard import current_tensors, mark_current

__all__ = ["collect_on_rank0", "gather_into"]


def collect_on_rank0(mesh: RankMesh, device: torch.device,
                     mine: Iterator[tuple[list[str], torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Collect (user names, tensor) pairs onto global rank 0, from one rank per pipeline stage
    (dp 0, tp 0), one tensor at a time; ``mine`` may be collective, so every rank drains it."""
    first_of_stage = mesh.dp_index == 0 and mesh.tp_index == 0
    if dist.get_rank() == 0:
        out: dict[str, torch.Tensor] = {}
        for names, t in mine:
            host = t.to("cpu", copy=True)
            for name in names:
                out.setdefault(name, host)
        for p in range(1, mesh.pp):  # the other stages' first ranks, in pipeline order
            src = mesh.rank_of(p, 0, 0)
            while True:
                header: list[Any] = [None]
                dist.recv_object_list(header, src=src, device=device)
                if header[0] is None:
                    break
                names, shape, dtype = header[0]
                buf = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buf, src=src)
                host = buf.cpu()
                for name in names:
                    out.setdefault(name, host)  # a weight tied across stages: the copies are equal
        return out
    if first_of_stage:
        for names, t in mine:
            dist.send_object_list([(names, tuple(t.shape), t.dtype)], dst=0, device=device)
            dist.send(t.contiguous(), dst=0)
        dist.send_object_list([None], dst=0, device=device)
    else:
        for _ in mine:  # take part in the stage's gathers
            pass
    return {}


@torch.no_grad()
def gather_into(model: nn.Module, full: dict[str, torch.Tensor], device: torch.device) -> None:
    """Copy ``full`` (every trained tensor by user name, on global rank 0; ``{}`` elsewhere) into
    ``model`` on every rank: rank 0 checks the names and copies, then broadcasts each of the model's
    tensors. Raises on every rank alike, before anything is copied, if the model does not fit."""
    own = current_tensors(model)
    params = {id(p) for p in model.parameters()}
    problem: list[Any] = [None]
    if dist.get_rank() == 0:
        missing = sorted(k for k, t in own.items() if k not in full and id(t) in params)
        unknown = sorted(k for k in full if k not in own)
        wrong = sorted(k for k in own if k in full and own[k].shape != full[k].shape)
        meta = sorted(k for k, t in own.items() if t.is_meta)
        said = [f"{what}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}" for what, keys in
                (("not trained by this module", missing), ("trained but not in the model", unknown),
                 ("of another shape", wrong), ("on the meta device (no storage to copy into)", meta)) if keys]
        problem[0] = "; ".join(said) or None
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise ValueError(f"pm.gather_into(model): the model's tensors do not match the trained ones ({problem[0]}); "
                         "give the model that was parallelized, or one built the same way")
    have = [None] if dist.get_rank() != 0 else [sorted(k for k in own if k in full)]
    dist.broadcast_object_list(have, src=0)  # a buffer the rank graphs do not hold keeps the model's value
    seen: set[int] = set()
    for name in have[0]:
        t = own[name]
        if id(t) in seen:  # a tied weight: one tensor under several names
            continue
        seen.add(id(t))
        buf = full[name].to(device=device, dtype=t.dtype) if dist.get_rank() == 0 else \
            torch.empty(t.shape, dtype=t.dtype, device=device)
        dist.broadcast(buf, src=0)
        t.copy_(buf)
    mark_current(model)
