"""Shrink the launched world to the ranks a plan uses, so the others can leave.

A plan may use fewer devices than were launched (7 ranks, a global batch of 8: dp 4 on 4 of them).
The runtime builds its mesh over the whole default process group, so :func:`regroup` replaces that
group by one over global ranks ``0..n-1``: rank 0 picks a free port on its host, every launched
rank learns it through the old group, every rank leaves the old group, and ranks below ``n`` join
the new one with the same backend and timeout. Ranks ``n`` and above hold no group afterwards and
return. ``WORLD_SIZE`` follows, so code that reads it sees the new world.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

from fairscale.runtime.launch import init_distributed
from fairscale.runtime.mesh import configured_timeout

__all__ = ["regroup"]


def regroup(n: int) -> bool:
    """Make the default process group span global ranks ``0..n-1``; True on those ranks, False on
    the ranks left out (which no longer have a process group). Collective over the launched world."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if not 1 <= n <= world:
        raise ValueError(f"cannot regroup {world} ranks into {n}")
    if n == world:
        return True
    box = [_address() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    host, port = box[0]
    backend = dist.get_backend()
    timeout = configured_timeout() or datetime.timedelta(minutes=30)  # torch's default, kept when none was set
    dist.barrier()  # nobody leaves while another still talks over the old group
    dist.destroy_process_group()
    if rank >= n:
        return False
    init_distributed(rank=rank, world_size=n, init_method=f"tcp://{host}:{port}", backend=backend,
                     timeout_s=timeout.total_seconds())
    os.environ["WORLD_SIZE"] = str(n)
    return True


def _address() -> tuple[str, int]:
    """Rank 0's address as the other ranks reach it (torchrun's MASTER_ADDR, else this host) and a
    port free on it now."""
    host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return host, int(s.getsockname()[1])
