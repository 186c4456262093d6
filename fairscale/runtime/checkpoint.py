"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): resumable at another world size, and
written atomically.

Usage (every rank calls both)::

    save_checkpoint("ckpt/step100", rank_gm, optimizer=opt)      # 4 ranks, fsdp
    ...
    load_checkpoint("ckpt/step100", rank_gm2, optimizer=opt2)    # 2 ranks, any kind

Layout: every parameter is a DTensor sharded on dim 0 over the dp ranks, keyed by the user's
state_dict key; optimizer state under ``optim.<key>.<name>`` (see ``fairscale.runtime.state``).
DCP re-slices those on load, which is what makes 4 → 2 (or fsdp → ddp) work.

Atomicity: DCP writes into ``<path>.tmp``; only after every rank finished (DCP writes its
``.metadata`` last, then a barrier) does rank 0 move an existing ``<path>`` to ``<path>.prev``,
rename ``<path>.tmp`` to ``<path>`` and delete ``<path>.prev``. A crash at any point leaves a
complete checkpoint at ``<path>`` or, during the two renames, at ``<path>.prev``, which
:func:`load_checkpoint` falls back to. The previous checkpoint is never modified in place.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fairscale.runtime import watchdog
from fairscale.runtime.device import collective_device
from fairscale.runtime.state import load_sharded_state_dict, sharded_state_dict

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_path", "commit_checkpoint", "prepare_save", "dp_mesh",
           "CheckpointSaveError"]


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank; the previous checkpoint is intact."""

_MESHES: dict[int, DeviceMesh] = {}


def dp_mesh() -> DeviceMesh:
    """A 1-D mesh over the whole world, named ``dp`` (the dp-only runner's layout)."""
    world = dist.get_world_size()
    if world not in _MESHES:
        # the world's default group (and its collective_timeout_s) is reused, except on a CUDA machine
        # running gloo, where init_device_mesh makes a new group: give that one the timeout too
        options = watchdog.group_options("gloo", watchdog.collective_timeout())
        override: Any = {"dp": ("gloo", options)} if (
            options is not None and torch.cuda.is_available() and dist.get_backend() == "gloo") else None
        _MESHES[world] = init_device_mesh(collective_device().type, (world,), mesh_dim_names=("dp",),
                                          backend_override=override)
    return _MESHES[world]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_path(path: str | os.PathLike[str]) -> Path:
    """The complete checkpoint at ``path``, or at ``path.prev`` if a save crashed between its renames."""
    path = Path(path)
    for candidate in (path, path.with_name(path.name + ".prev")):
        if (candidate / ".metadata").exists():
            return candidate
    raise FileNotFoundError(f"no complete checkpoint at {path} (a DCP checkpoint has a .metadata file); "
                            f"an interrupted save leaves only {path.name}.tmp, which is never loaded")


def commit_checkpoint(tmp: Path, path: Path) -> None:
    """Move a finished save at ``tmp`` into place at ``path``, keeping the previous checkpoint as
    ``<path>.prev`` until the rename is done (and finishing a commit a crash interrupted), so a
    crash at any point leaves one complete checkpoint. Rank 0 only."""
    prev = path.with_name(path.name + ".prev")
    if not (path / ".metadata").exists() and (prev / ".metadata").exists():
        if path.exists():
            shutil.rmtree(path)
        os.rename(prev, path)  # finish a commit a crash interrupted, so prev is free again
    elif prev.exists():
        shutil.rmtree(prev)
    if path.exists():
        os.rename(path, prev)
    os.rename(tmp, path)
    if prev.exists():
        shutil.rmtree(prev)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_save(path: Path) -> Path:
    """Rank 0 makes ``path``'s parent and clears debris of an interrupted save, and every rank learns
    whether it could before anything is written (a failure on rank 0 alone, a file where the
    directory goes, had left the others in a barrier until the collective timeout); raises
    :class:`CheckpointSaveError` on every rank if not. Returns the directory DCP writes into. Collective."""
    tmp = path.with_name(path.name + ".tmp")
    problem = [_place(path, tmp) if _rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(problem, src=0, device=collective_device())
    if problem[0] is not None:
        raise CheckpointSaveError(problem[0])
    return tmp


def _place(path: Path, tmp: Path) -> str | None:
    """Make ``path``'s parent and clear debris of an interrupted save at ``tmp``; why not, or None."""
    for p in (path, tmp, path.with_name(path.name + ".prev")):
        if p.exists() and not p.is_dir():
            return (f"cannot save a checkpoint at {path}: {p} is a file, and a checkpoint is a directory; nothing "
                    "was written: pass the path of a directory (new, or a checkpoint to replace)")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)  # debris of an interrupted save, never a complete checkpoint
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot save a checkpoint at {path}: {exc}; nothing was written"
    return None


def save_checkpoint(path: str | os.PathLike[str], gm: torch.fx.GraphModule, *, optimizer: Any = None,
                    mesh: DeviceMesh | None = None) -> Path:
    """Save parameters (and optimizer state) of this rank's graph to the directory ``path``. Collective."""
    import torch.distributed.checkpoint as dcp  # (imported here, not at the top: ~1 s that planning never needs)
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    mesh = mesh or dp_mesh()
    tmp = prepare_save(path)
    state = sharded_state_dict(gm, mesh, optimizer=optimizer)
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)))
    except CheckpointException as exc:  # a BaseException in DCP; surface it as an ordinary error
        failures = "; ".join(f"rank {r}: {(e[0] if isinstance(e, tuple) else e)!r}" for r, e in exc.failures.items())
        raise CheckpointSaveError(f"saving the checkpoint {path} failed ({failures}); the previous checkpoint "
                                  f"at {path} is untouched, the partial {tmp.name} is removed by the next save") from exc
    _barrier()
    if _rank() == 0:
        commit_checkpoint(tmp, path)
    _barrier()
    return path


def load_checkpoint(path: str | os.PathLike[str], gm: torch.fx.GraphModule, *, optimizer: Any = None,
                    mesh: DeviceMesh | None = None) -> None:
    """Load a checkpoint saved by :func:`save_checkpoint` at any dp size into this rank's graph. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
    from torch.distributed.tensor import DTensor, Shard

    where = checkpoint_path(path)
    mesh = mesh or dp_mesh()
    reader = dcp.FileSystemReader(str(where))
    meta = reader.read_metadata()
    state: dict[str, Any] = {}
    for key, item in meta.state_dict_metadata.items():
        if key.startswith("optim.") and optimizer is None:
            continue
        if isinstance(item, BytesStorageMetadata):
            state[key] = None
        elif isinstance(item, TensorStorageMetadata):
            shape = tuple(item.size)
            dtype = item.properties.dtype
            if len(shape) == 0:
                state[key] = torch.zeros((), dtype=dtype, device=mesh.device_type)
            else:
                n, i = mesh.size(), mesh.get_local_rank()
                per = -(-shape[0] // n)
                rows = max(0, min((i + 1) * per, shape[0]) - min(i * per, shape[0]))
                local = torch.zeros((rows, *shape[1:]), dtype=dtype, device=mesh.device_type)
                stride = torch.empty(shape, device="meta").stride()
                state[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
    dcp.load(state, storage_reader=reader)
    load_sharded_state_dict(gm, state, optimizer=optimizer)
