"""Model-parallel process groups (FairScale 0.4.13's ``fairscale.nn.model_parallel.initialize``).

The world is laid out as ``data × pipeline × model`` with model-parallel ranks innermost, as in
FairScale (and Megatron-LM): with 8 ranks, ``model_parallel_size=2`` and ``pipeline_length=2``::

    rank = (data_index * pipeline_length + pipeline_index) * model_parallel_size + model_index
    model-parallel groups:  [0 1] [2 3] [4 5] [6 7]
    pipeline groups:        [0 2] [1 3] [4 6] [5 7]
    data-parallel groups:   [0 4] [1 5] [2 6] [3 7]

The groups are bound to ``passes.ops.comm`` axes named :data:`MODEL_AXIS`, :data:`DATA_AXIS` and
:data:`PIPELINE_AXIS`, so the layers' collectives are counted with everything else.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C._distributed_c10d import ProcessGroup

from passes.ops import comm

__all__ = ["initialize_model_parallel", "model_parallel_is_initialized", "destroy_model_parallel",
           "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
           "get_model_parallel_src_rank", "get_data_parallel_group", "get_data_parallel_rank",
           "get_data_parallel_world_size", "get_pipeline_parallel_group", "get_pipeline_parallel_ranks",
           "MODEL_AXIS", "DATA_AXIS", "PIPELINE_AXIS"]

MODEL_AXIS = "model_parallel"
DATA_AXIS = "data_parallel"
PIPELINE_AXIS = "pipeline_parallel"

_STATE: dict[str, Any] = {}


def initialize_model_parallel(model_parallel_size: int, pipeline_length: int = 1, *,
                              model_parallel_backend: str | None = None, pipeline_backend: str | None = None,
                              ddp_backend: str | None = None) -> None:
    """Split the world into model-, pipeline- and data-parallel groups (every rank must call this).

    Args:
        model_parallel_size: ranks that share one layer's weights (tensor parallelism).
        pipeline_length: ranks along one pipeline.
        model_parallel_backend, pipeline_backend, ddp_backend: torch.distributed backend of each kind
            of group (default: the world's backend).
    """
    dist = torch.distributed  # looked up per call, as FairScale did (tests substitute a stand-in module)
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed initialized "
                           "(use fairscale.launch or torchrun)")
    world = dist.get_world_size()
    if model_parallel_size < 1 or pipeline_length < 1 or world % (model_parallel_size * pipeline_length):
        raise ValueError(f"model_parallel_size({model_parallel_size}) × pipeline_length({pipeline_length}) = "
                         f"{model_parallel_size * pipeline_length} must divide the world size {world}")
    if _STATE:
        raise RuntimeError("model parallel is already initialized; call destroy_model_parallel() first")
    mp, pp = model_parallel_size, pipeline_length
    dp = world // (mp * pp)
    rank = dist.get_rank()

    def rank_of(d: int, p: int, m: int) -> int:
        return (d * pp + p) * mp + m

    # new_group must be called by every rank for every group, in the same order
    for d in range(dp):
        for p in range(pp):
            ranks = [rank_of(d, p, m) for m in range(mp)]
            g = dist.new_group(ranks, backend=model_parallel_backend)
            if rank in ranks:
                _STATE["model"] = (g, ranks)
    for d in range(dp):
        for m in range(mp):
            ranks = [rank_of(d, p, m) for p in range(pp)]
            g = dist.new_group(ranks, backend=pipeline_backend)
            if rank in ranks:
                _STATE["pipeline"] = (g, ranks)
    for p in range(pp):
        for m in range(mp):
            ranks = [rank_of(d, p, m) for d in range(dp)]
            g = dist.new_group(ranks, backend=ddp_backend)
            if rank in ranks:
                _STATE["data"] = (g, ranks)
    for axis, kind, size in ((MODEL_AXIS, "model", mp), (PIPELINE_AXIS, "pipeline", pp), (DATA_AXIS, "data", dp)):
        group = _STATE[kind][0]
        comm.set_group(axis, group if size > 1 and isinstance(group, ProcessGroup) else None)


def model_parallel_is_initialized() -> bool:
    return bool(_STATE)


def _get(kind: str) -> tuple[Any, list[int]]:
    if kind not in _STATE:
        raise RuntimeError("model parallel is not initialized: call "
                           "fairscale.nn.model_parallel.initialize_model_parallel(model_parallel_size) first")
    return _STATE[kind]


def get_model_parallel_group() -> Any:
    return _get("model")[0]


def get_model_parallel_world_size() -> int:
    return len(_get("model")[1])


def get_model_parallel_rank() -> int:
    return _get("model")[1].index(torch.distributed.get_rank())


def get_model_parallel_src_rank() -> int:
    """Global rank of model-parallel index 0 in this rank's group."""
    return _get("model")[1][0]


def get_data_parallel_group() -> Any:
    return _get("data")[0]


def get_data_parallel_world_size() -> int:
    return len(_get("data")[1])


def get_data_parallel_rank() -> int:
    return _get("data")[1].index(torch.distributed.get_rank())


def get_pipeline_parallel_group() -> Any:
    return _get("pipeline")[0]


def get_pipeline_parallel_ranks() -> list[int]:
    return list(_get("pipeline")[1])


def destroy_model_parallel() -> None:
    """Forget the groups and unbind the comm axes (the process groups are left to torch.distributed)."""
    _STATE.clear()
    for axis in (MODEL_AXIS, DATA_AXIS, PIPELINE_AXIS):
        comm.set_group(axis, None)
