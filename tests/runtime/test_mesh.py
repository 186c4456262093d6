"""The pp × dp × tp mesh: rank order and the process groups bound to each axis."""

import torch
import torch.distributed as dist

import fairscale
from fairscale.runtime.mesh import RankMesh, build_mesh
from passes.ops import comm


def test_rank_order_puts_tp_innermost():
    mesh = RankMesh(2, 2, 2, rank=5)
    assert mesh.coords() == (1, 0, 1)
    assert [mesh.rank_of(*mesh.coords(r)) for r in range(8)] == list(range(8))
    assert mesh.stage_peer(0) == 1


def _groups(rank, world):
    mesh, _ = build_mesh(2, 2, 2)
    with mesh.groups.active():
        members = {}
        for axis in ("pp", "dp", "tp"):
            t = torch.tensor([float(rank)])
            out = torch.empty(comm.group_size(axis))
            comm.all_gather_flat(out, t, axis)
            members[axis] = out.int().tolist()
        return members


def test_axes_are_bound_to_the_right_ranks():
    results = fairscale.launch(_groups, devices=8)
    assert results[5] == {"pp": [1, 5], "dp": [5, 7], "tp": [4, 5]}
    assert results[0] == {"pp": [0, 4], "dp": [0, 2], "tp": [0, 1]}
