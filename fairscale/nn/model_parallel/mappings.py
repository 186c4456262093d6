"""FairScale/Megatron region mappings, on ``passes.ops.comm``'s autograd-paired collectives.

Megatron-LM (Shoeybi et al. 2019, section 3): ``f`` = copy (identity forward, all-reduce backward),
``g`` = reduce (all-reduce forward, identity backward); scatter/gather split the last dimension.
"""

from __future__ import annotations

import torch

from fairscale.nn.model_parallel.initialize import MODEL_AXIS
from passes.ops import comm

__all__ = ["copy_to_model_parallel_region", "reduce_from_model_parallel_region",
           "scatter_to_model_parallel_region", "gather_from_model_parallel_region"]


def copy_to_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return comm.copy_to_group(x, MODEL_AXIS)


def reduce_from_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return comm.reduce_from_group(x, MODEL_AXIS)


def scatter_to_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return comm.scatter_to_group(x, MODEL_AXIS, -1)


def gather_from_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return comm.gather_from_group(x, MODEL_AXIS, -1)
