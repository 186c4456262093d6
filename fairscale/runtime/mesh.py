"""The pp × dp × tp device mesh of a plan, and the binding of its axes to process groups.

Rank order puts tp innermost, then dp, then pp, so tensor-parallel groups are consecutive ranks
(inside one node) and pipeline neighbours are ``dp × tp`` ranks apart::

    rank = (pp_index * dp + dp_index) * tp + tp_index

    pp=2, dp=2, tp=2:   stage 0: [0 1] [2 3]     stage 1: [4 5] [6 7]
                               tp↔      dp↕

Expert parallelism (``ep`` dividing dp) splits the dp axis in two more groups: ``ep``, blocks of
``ep`` consecutive dp ranks that share out the experts, and ``ep_rep``, the dp/ep ranks at the same
place in their blocks, which hold the same experts::

    dp=4, ep=2:   dp ranks 0 1 2 3   ep groups {0,1} {2,3}   ep_rep groups {0,2} {1,3}

The axis names are bound in the mesh's own table (``RankMesh.groups``), not process-wide: two
modules in one process each keep their groups (``passes.ops.groups``).

Every group gets the world's ``collective_timeout_s`` (``fairscale.runtime.watchdog``), not torch's
30-minute default for new groups, and binding the mesh starts the rank's watchdog heartbeat.

A mesh's groups live until :func:`release_mesh` (a module that is retired or closed calls it): a
gloo group runs worker threads that wake about every 10 ms, so groups left behind by earlier
modules cost every later step of the process CPU (measured: 0.5-1.3 ms of CPU per idle group per
second per rank, and a busier scheduler: 15 threads per rank became 96 after seven plans).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fairscale.runtime import watchdog
from passes.ops.groups import AxisGroups

__all__ = ["RankMesh", "build_mesh", "release_mesh"]

AXES = ("pp", "dp", "tp")
_MESHES = itertools.count()  # names meshes in errors


@dataclass(frozen=True)
class RankMesh:
    """A pp × dp × tp mesh seen from one rank."""

    pp: int
    dp: int
    tp: int
    rank: int
    groups: AxisGroups = field(default_factory=lambda: AxisGroups("a mesh"), compare=False, repr=False)
    """What each axis name means on this rank (``passes.ops.groups``): the module that holds the
    mesh runs under ``with mesh.groups.active():``."""

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int | None = None) -> tuple[int, int, int]:
        """(pp_index, dp_index, tp_index) of ``rank`` (default: this rank)."""
        r = self.rank if rank is None else rank
        return r // (self.dp * self.tp), (r // self.tp) % self.dp, r % self.tp

    def rank_of(self, pp_index: int, dp_index: int, tp_index: int) -> int:
        return (pp_index * self.dp + dp_index) * self.tp + tp_index

    @property
    def pp_index(self) -> int:
        return self.coords()[0]

    @property
    def dp_index(self) -> int:
        return self.coords()[1]

    @property
    def tp_index(self) -> int:
        return self.coords()[2]

    def stage_peer(self, pp_index: int) -> int:
        """Global rank holding stage ``pp_index`` with this rank's dp and tp coordinates."""
        _, d, t = self.coords()
        return self.rank_of(pp_index, d, t)


def build_mesh(pp: int, dp: int, tp: int, *, ep: int = 1,
               device_type: str | None = None) -> tuple[RankMesh, DeviceMesh]:
    """Create the DeviceMesh for pp × dp × tp on the current world and bind its axes in the mesh's
    own table, ``mesh.groups`` (``pp``, ``dp``, ``tp``, and with ``ep > 1`` the ``ep`` and
    ``ep_rep`` sub-axes of dp): code that runs collectives by axis name runs under
    ``with mesh.groups.active():``, as a ``ParallelModule`` does.

    Every rank must call this (it creates process groups). Size-1 axes are bound to ``None``.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs torch.distributed initialized; run under fairscale.launch or torchrun")
    world = dist.get_world_size()
    if pp * dp * tp != world:
        raise ValueError(f"mesh pp({pp}) × dp({dp}) × tp({tp}) = {pp * dp * tp}, but the world has {world} ranks")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    timeout = watchdog.collective_timeout()
    backend = dist.get_backend()
    options = watchdog.group_options(backend, timeout)
    override: Any = {axis: (backend, options) for axis in AXES} if options is not None else None
    device_mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=AXES, backend_override=override)
    sizes: dict[str, Any] = {"pp": pp, "dp": dp, "tp": tp}
    mesh = RankMesh(pp, dp, tp, dist.get_rank(), AxisGroups(f"the pp{pp}×dp{dp}×tp{tp} mesh #{next(_MESHES)}"))
    for axis in AXES:
        mesh.groups.bind(axis, device_mesh.get_group(axis) if sizes[axis] > 1 else None)
    _bind_expert_axes(mesh, ep, timeout)
    p, d, t = mesh.coords()
    watchdog.install(label=f"pp {p}, dp {d}, tp {t}")
    return mesh, device_mesh


def _bind_expert_axes(mesh: RankMesh, ep: int, timeout: Any) -> None:
    """Create the ``ep`` and ``ep_rep`` groups (every rank creates every group, in one order)."""
    if ep < 1 or mesh.dp % ep:
        raise ValueError(f"mesh ep({ep}) must divide dp({mesh.dp})")
    mesh.groups.bind("ep", None)
    mesh.groups.bind("ep_rep", None)
    if ep == 1:
        return
    me = mesh.coords()
    for p in range(mesh.pp):
        for t in range(mesh.tp):
            blocks = [[mesh.rank_of(p, b * ep + j, t) for j in range(ep)] for b in range(mesh.dp // ep)]
            for axis, groups in (("ep", blocks), ("ep_rep", [list(g) for g in zip(*blocks)])):
                for ranks in groups:
                    group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                    if mesh.rank in ranks and me[0] == p and me[2] == t:
                        mesh.groups.bind(axis, group)


def release_mesh(mesh: RankMesh, device_mesh: DeviceMesh) -> int:
    """Destroy the process groups :func:`build_mesh` made for ``mesh`` (its axes' and expert axes'
    groups; not the world's default group, which an axis spanning every rank may reuse) and unbind
    them; returns how many this rank destroyed. Collective: every rank calls it alike; a barrier
    first, so no rank tears down a group a peer is still using."""
    groups: list[Any] = [device_mesh.get_group(axis) for axis in AXES]
    groups += [mesh.groups.get(axis) for axis in ("ep", "ep_rep") if mesh.groups.has_live_group(axis)]
    default = dist.distributed_c10d._get_default_group()
    mine = [g for i, g in enumerate(groups) if g is not None and g is not default and g not in groups[:i]]
    dist.barrier()
    for group in mine:
        dist.destroy_process_group(group)
    mesh.groups.clear()
    return len(mine)
