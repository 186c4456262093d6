"""Move a ParallelModule's training state to another module of the same model on the same ranks,
in memory: what ``fairscale.switch_plan`` runs once the new plan is checked.

The state moves through the mapping an any-plan checkpoint uses (``engine_checkpoint``): the full
state in the user's keys. Each stage's dp × tp ranks gather their tensors one at a time and keep a
share of them on the host (``full_state_share``: parameters, buffers, the optimizer's moments and
step counts; a tied weight and its optimizer state under every name of the tie); the old module
is then released, the new one built, and each rank receives from their holders exactly the keys
its new stages load (``wanted_keys``), then cuts its own slices and shards (``load_full_state``).
A rank's host holds its share of the old stages plus the full tensors of its new stages at the peak.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from fairscale.runtime.engine import ParallelModule
from fairscale.runtime.engine_checkpoint import full_state_share, load_full_state, wanted_keys

__all__ = ["reshard", "redistribute"]


def reshard(old: ParallelModule, build: Callable[[], ParallelModule]) -> ParallelModule:
    """Gather ``old``'s state, retire ``old``, ``build()`` the new module and load the state into
    it; returns the new module. Collective: every rank calls it."""
    with old.mesh.groups.active():
        share = full_state_share(old._stage_states(), old.mesh, old.rank_program.tied)
    m = old.plan.mesh
    old.retire(f"this ParallelModule (pp{m.pp}×dp{m.dp}×tp{m.tp}) was switched to another plan; use the "
               "module fairscale.switch_plan returned")
    new = build()
    stages = new._stage_states()
    state = redistribute(share, lambda available: wanted_keys(stages, available), device=new.device)
    with new.mesh.groups.active():
        load_full_state(stages, state)
    dist.barrier()
    return new


def redistribute(share: dict[str, Any], wanted: Callable[[set[str]], set[str]], *,
                 device: torch.device) -> dict[str, Any]:
    """Every rank holds ``share`` (key -> host tensor; the JSON ``optim.param_groups`` is the same
    everywhere) and returns the keys ``wanted(all keys)`` names, from whichever rank holds each.
    Collective over the world: the keys are sent point to point in one global order (the lowest
    holder sends to each rank that wants a key), which every rank walks alike, so the blocking
    sends and receives never wait on each other in a cycle. Tensors travel on ``device`` (the
    process group's device) and arrive in host memory."""
    world, me = dist.get_world_size(), dist.get_rank()
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in share.items() if isinstance(v, torch.Tensor)}
    held: list[Any] = [None] * world
    dist.all_gather_object(held, shapes)
    owner: dict[str, int] = {}
    for rank, keys in enumerate(held):
        for key in keys:
            owner.setdefault(key, rank)
    mine = wanted(set(owner))
    needs: list[Any] = [None] * world
    dist.all_gather_object(needs, sorted(mine))
    wants = [set(n) for n in needs]
    out: dict[str, Any] = {k: v for k, v in share.items() if not isinstance(v, torch.Tensor)}
    for key in sorted(owner):
        src = owner[key]
        if me == src:
            if key in mine:
                out[key] = share[key]
            t = share[key].to(device).contiguous()
            for dst in range(world):
                if dst != src and key in wants[dst]:
                    dist.send(t, dst)
        elif key in mine:
            shape, dtype = held[src][key]
            buf = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buf, src)
            out[key] = buf.cpu()
    return out
