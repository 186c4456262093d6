"""Checkpoints of a ParallelModule that resume under any other plan (2×2×2 → 1×4×2 → 8×1×1).

Saving: every rank gathers, for its own stages, the full tensors in the user's keys (parameters
over dp and tp, and the optimizer's per-parameter state, ``optim.<key>.<name>``), and
``torch.distributed.checkpoint`` writes them. Keys held by several ranks (a stage's dp and tp
replicas, a tied weight on two stages) are written once. The write goes to ``<path>.tmp`` and is
renamed into place after every rank finished, so a crash mid-save never harms the previous one.

Loading: each rank reads only its stages' keys and cuts its own slices and shards for the new
plan. Resuming continues exactly as if training had not stopped (same weights, same Adam moments
and step counts).

The gathered stage tensors are held on each rank while saving, so this suits models whose stage
fits in host memory; data-parallel-only runs can use the per-rank sharded form in
``fairscale.runtime.checkpoint``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from fairscale.runtime.checkpoint import checkpoint_path, commit_checkpoint
from passes.layout import INSIDE_DP
from fairscale.runtime.state import (full_state_dict, gather_tensor_shard, held_keys, load_full_state_dict,
                                     load_optimizer_state_dict, optimizer_state_dict, param_layout, tied_aliases)

if TYPE_CHECKING:
    from fairscale.runtime.engine import ParallelModule

__all__ = ["save", "load"]


def _stage_state(pm: ParallelModule) -> dict[str, Any]:
    dp_mesh = pm.device_mesh["dp"]
    state: dict[str, Any] = {}
    for s, opt in zip(pm.local_stages, pm._optimizers):
        gm = pm.modules[s]
        layout = param_layout(gm)
        state.update(full_state_dict(gm, aliases=pm.graph.tied, rank0_only=False))
        for name, value in optimizer_state_dict(gm, opt, dp_mesh).items():
            key = name[len("optim."):].rsplit(".", 1)[0]
            if isinstance(value, DTensor):
                value = gather_tensor_shard(key, value.full_tensor(), layout)
            elif isinstance(value, torch.Tensor) and value.dim() > 0 and key in layout.tp \
                    and layout.tp[key].axis in INSIDE_DP:
                value = gather_tensor_shard(key, value, layout)  # an expert shard: gathered over ep
            state[name] = value
    return state


def save(pm: ParallelModule, path: str | os.PathLike[str]) -> Path:
    """Save model and optimizer state in the user's keys to the directory ``path``. Collective."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if dist.get_rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # debris of an interrupted save, never a complete checkpoint
        path.parent.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dcp.save(_stage_state(pm), storage_writer=dcp.FileSystemWriter(str(tmp)))
    dist.barrier()
    if dist.get_rank() == 0:
        commit_checkpoint(tmp, path)
    dist.barrier()
    return path


def load(pm: ParallelModule, path: str | os.PathLike[str]) -> None:
    """Load a checkpoint written by :func:`save` under any plan into this rank's stages. Collective."""
    reader = dcp.FileSystemReader(str(checkpoint_path(path)))
    meta = reader.read_metadata().state_dict_metadata
    wanted: set[str] = {"optim.param_groups"}
    for s in pm.local_stages:
        gm = pm.modules[s]
        for key in held_keys(gm):
            names = [key, *tied_aliases(gm).get(key, [])]
            wanted.update(names)
            wanted.update(k for k in meta for n in names if k.startswith(f"optim.{n}."))
    template: dict[str, Any] = {}
    for key in sorted(wanted & set(meta)):
        item = meta[key]
        if isinstance(item, BytesStorageMetadata):
            template[key] = None
        elif isinstance(item, TensorStorageMetadata):
            template[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    dcp.load(template, storage_reader=reader)
    for s, opt in zip(pm.local_stages, pm._optimizers):
        gm = pm.modules[s]
        layout = param_layout(gm)
        load_full_state_dict(gm, {k: v for k, v in template.items() if not k.startswith("optim.")})
        optim: dict[str, Any] = {}
        for name, value in template.items():
            if not name.startswith("optim."):
                continue
            key = name[len("optim."):].rsplit(".", 1)[0]
            spec = layout.tp.get(key)
            optim[name] = spec.slice(value) if spec is not None and isinstance(value, torch.Tensor) \
                and value.dim() > 0 else value
        load_optimizer_state_dict(gm, opt, optim)
        for bucket in opt.info.buckets:
            if bucket.shard is not None:
                bucket.gather_params()
    dist.barrier()
