"""Checkpoints of a ParallelModule that resume under any other plan (2×2×2 → 1×4×2 → 8×1×1).

Saving: the ranks of each stage gather its full tensors in the user's keys (parameters over dp
and tp, and the optimizer's per-parameter state, ``optim.<key>.<name>``) one tensor, ZeRO bucket or
FSDP unit at a time (``fairscale.runtime.state_stream``), and the stage's dp × tp ranks share the
writing: the i-th tensor stays, in host memory, on rank ``i mod (dp × tp)`` of the stage only. So a
device never holds more than its shards plus one gathered unit, each rank's host holds about
1/(dp × tp) of its stage, and every rank writes its own share (``torch.distributed.checkpoint``;
a weight tied across stages is written once). The write goes to ``<path>.tmp`` and is renamed into
place after every rank finished, so a crash mid-save never harms the previous one.

Loading: each rank reads only its stages' keys and cuts its own slices and shards for the new
plan. Resuming continues exactly as if training had not stopped (same weights, same Adam moments
and step counts).

Loading reads each of a rank's stages' keys whole into host memory (then copies its own slices
and shards to the device), so a rank's host must hold its stages' tensors once while loading.
Optimizer state lands on its parameter's device (``step`` stays on the host, as torch.optim keeps it).
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.fx
import torch.distributed as dist

from fairscale.runtime.checkpoint import checkpoint_path, commit_checkpoint, prepare_save
from fairscale.runtime.mesh import RankMesh
from fairscale.runtime.optim import DataParallelOptimizer
from fairscale.runtime.state import (held_keys, load_full_state_dict, load_optimizer_state_dict, param_layout,
                                     tied_aliases)
from fairscale.runtime.state_stream import iter_full_state, iter_optimizer_state

__all__ = ["save", "load", "StageState", "full_state_share", "wanted_keys", "load_full_state"]

StageState = tuple[torch.fx.GraphModule, DataParallelOptimizer]
"""One of a rank's stages: its compiled graph and the optimizer over its local tensors."""


def full_state_share(stages: Sequence[StageState], mesh: RankMesh, tied: list[list[str]]) -> dict[str, Any]:
    """This rank's share of the full training state in the user's keys, on the host: every (dp ×
    tp)-th one of its stages' gathered tensors (parameters and buffers under every name of a tied
    group, and the optimizer's per-parameter state ``optim.<key>.<name>`` under every name too, so
    that a plan holding the tied tensor under any of its names finds its moments and step count),
    plus ``optim.param_groups`` (one JSON string, the same on every rank). What a checkpoint writes
    (:func:`save`) and what a live switch of plans sends (``fairscale.runtime.reshard``). Collective over
    each stage's dp and tp groups."""
    share: dict[str, Any] = {}
    writers = mesh.dp * mesh.tp
    me = mesh.dp_index * mesh.tp + mesh.tp_index
    for gm, opt in stages:
        # every name of a tied tensor is written (another plan may hold it under any of them)
        params = ((n, t) for names, t in iter_full_state(gm, aliases=tied) for n in names)
        states = ((name, v) for names, v in iter_optimizer_state(gm, opt, aliases=tied) for name in names)
        for i, (name, value) in enumerate(itertools.chain(params, states)):
            if i % writers == me:
                share[name] = value.to("cpu", copy=True) if isinstance(value, torch.Tensor) else \
                    torch.tensor(value, device="cpu")  # lint: cpu -- a Python scalar state, saved as a tensor
    # identical on every rank (one optimizer spec): DCP writes it once
    share["optim.param_groups"] = json.dumps([{k: v for k, v in g.items() if k != "params"}
                                              for g in stages[-1][1].param_groups], default=str)
    return share


def wanted_keys(stages: Sequence[StageState], available: Iterable[str]) -> set[str]:
    """The keys of ``available`` (a full state in the user's keys, as :func:`full_state_share`
    names them) that a rank's ``stages`` load: their tensors under any of their names, and those
    names' optimizer state."""
    available = set(available)
    wanted: set[str] = {"optim.param_groups"}
    for gm, _ in stages:
        for key in held_keys(gm):
            names = [key, *tied_aliases(gm).get(key, [])]
            wanted.update(names)
            wanted.update(k for k in available for n in names if k.startswith(f"optim.{n}."))
    return wanted & available


def load_full_state(stages: Sequence[StageState], state: dict[str, Any]) -> None:
    """Copy a full state in the user's keys (host tensors holding at least :func:`wanted_keys`)
    into a rank's ``stages``: each takes its tensor-parallel slices and data-parallel shards, and
    its optimizer its state. Local (no collective)."""
    for gm, opt in stages:
        layout = param_layout(gm)
        load_full_state_dict(gm, {k: v for k, v in state.items() if not k.startswith("optim.")})
        optim: dict[str, Any] = {}
        for name, value in state.items():
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


def save(path: str | os.PathLike[str], stages: Sequence[StageState], *, mesh: RankMesh,
         tied: list[list[str]]) -> Path:
    """Save model and optimizer state of a rank's ``stages`` in the user's keys to the directory
    ``path`` (``tied``: groups of keys naming one tensor). Collective."""
    import torch.distributed.checkpoint as dcp  # (imported here, not at the top: ~1 s that planning never needs)

    path = Path(path)
    tmp = prepare_save(path)
    dcp.save(full_state_share(stages, mesh, tied), storage_writer=dcp.FileSystemWriter(str(tmp)))
    dist.barrier()
    if dist.get_rank() == 0:
        commit_checkpoint(tmp, path)
    dist.barrier()
    return path


def load(path: str | os.PathLike[str], stages: Sequence[StageState], *, model: torch.nn.Module | None = None) -> None:
    """Load a checkpoint written by :func:`save` under any plan into a rank's ``stages``. Collective.
    ``model``: the user's model, whose names and shapes the checkpoint must have (None: not checked)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    reader = dcp.FileSystemReader(str(checkpoint_path(path)))
    meta = reader.read_metadata().state_dict_metadata
    if model is not None:
        _check_model(path, {k: tuple(v.size) for k, v in meta.items()
                            if isinstance(v, TensorStorageMetadata) and not k.startswith("optim.")}, model)
    template: dict[str, Any] = {}
    for key in sorted(wanted_keys(stages, meta)):
        item = meta[key]
        if isinstance(item, BytesStorageMetadata):
            template[key] = None
        elif isinstance(item, TensorStorageMetadata):
            # lint: cpu -- read into host memory; load_full_state copies each rank's part to its device
            template[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype, device="cpu")
    dcp.load(template, storage_reader=reader)
    _check_groups(path, template.get("optim.param_groups"), stages)
    load_full_state(stages, template)
    dist.barrier()


_SAME_MODEL = ("load it into the model it was saved from (the same class and configuration), or load the weights "
               "you want into the model before fairscale.parallelize (model.load_state_dict(..., strict=False))")


def _check_model(path: str | os.PathLike[str], shapes: dict[str, tuple[int, ...]], model: torch.nn.Module) -> None:
    """Refuse a checkpoint of another model before anything is loaded, as torch's strict
    ``load_state_dict`` does: keys the model has no tensor of had been skipped silently (a
    4-layer model's checkpoint resumed a 2-layer one), and tensors of another shape failed inside a
    copy naming no key ('The size of tensor a (48) must match ...'). Missing keys are refused
    where a rank finds them (``fairscale.runtime.state.load_full_state_dict``)."""
    mine = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    unexpected = sorted(k for k in shapes if k not in mine)
    other = [f"{k} is {list(v)} there and {list(mine[k].shape)} here" for k, v in sorted(shapes.items())
             if k in mine and v != tuple(mine[k].shape)]
    problems = ([f"{len(unexpected)} tensor(s) this model has none of, e.g. {', '.join(unexpected[:5])}"]
                if unexpected else []) + ([f"{len(other)} tensor(s) of another shape: {'; '.join(other[:3])}"]
                                          if other else [])
    if problems:
        raise ValueError(f"pm.load_checkpoint({str(path)!r}): the checkpoint is not of this model "
                         f"({type(model).__name__}): it holds {', and '.join(problems)}; {_SAME_MODEL}")


def _check_groups(path: str | os.PathLike[str], saved: Any, stages: Sequence[StageState]) -> None:
    """Refuse a checkpoint whose optimizer had another number of parameter groups (torch.optim's
    ``load_state_dict`` does): the groups' options were paired up to the shorter list, so a
    one-group optimizer resumed with the first group's weight decay on every parameter."""
    groups = json.loads(saved) if isinstance(saved, str) else saved
    if not isinstance(groups, list) or not stages:
        return
    have = len(stages[-1][1].param_groups)
    if len(groups) != have:
        raise ValueError(f"pm.load_checkpoint({str(path)!r}): the checkpoint's optimizer has {len(groups)} parameter "
                         f"group(s) and pm.optimizer has {have}: build the optimizer given to fairscale.parallelize "
                         "with the groups of the run that saved it (the same parameters in each, in the same order)")
