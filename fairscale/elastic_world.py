"""Shrink the launched world to the ranks a plan uses, so the others can leave.

A plan may use fewer devices than were launched (7 ranks, a global batch of 8: dp 4 on 4 of them).
The runtime builds its mesh over the whole default process group, so :func:`regroup` replaces that
group by one over global ranks ``0..n-1``: every rank leaves the old group, and ranks below ``n``
join a new one with the same backend and timeout, meeting in the old group's store under a fresh
prefix (the store is fairscale.launch's, hosted by rank 0, which stays, or torchrun's agent's).
Ranks ``n`` and above hold no group afterwards and return. ``WORLD_SIZE`` follows, so code that
reads it sees the new world.
"""

from __future__ import annotations

import datetime
import itertools
import os

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from fairscale.runtime.watchdog import collective_timeout

__all__ = ["regroup"]

_GENERATION = itertools.count()
"""Store prefixes of successive regroups in one process never collide."""


def regroup(n: int) -> bool:
    """Make the default process group span global ranks ``0..n-1``; True on those ranks, False on
    the ranks left out (which no longer have a process group). Collective over the launched world."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if not 1 <= n <= world:
        raise ValueError(f"cannot regroup {world} ranks into {n}")
    if n == world:
        return True
    store = c10d._get_default_store()  # held here, so it outlives the group it served
    backend = dist.get_backend()
    timeout = collective_timeout() or datetime.timedelta(minutes=30)  # torch's default, kept when none was set
    prefix = f"fairscale/regroup/{next(_GENERATION)}/{world}->{n}/"
    dist.barrier()  # nobody leaves while another still talks over the old group
    dist.destroy_process_group()
    if rank >= n:
        return False
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=n,
                            timeout=timeout)
    os.environ["WORLD_SIZE"] = str(n)
    return True
