"""Megatron-style tensor-parallel layers (FairScale 0.4.13's ``fairscale.nn.model_parallel.layers``).

Shoeybi et al. 2019, "Megatron-LM", section 3. Each rank of the model-parallel group holds a
slice of the weight. Parameters start from the *dense* initialization: every rank builds the
full master weight with ``init_method`` on the CPU, with the CPU generator (so seed all ranks
alike, e.g. ``torch.manual_seed(0)``; the model-parallel CUDA seeds differ per rank on purpose),
then keeps its slice on the default device, so a model-parallel layer starts exactly where the
dense layer would::

    initialize_model_parallel(2)
    torch.manual_seed(0)
    up = ColumnParallelLinear(64, 256, gather_output=False)   # each rank: 128 output features
    down = RowParallelLinear(256, 64, input_is_parallel=True) # each rank: 128 input features
    y = down(F.gelu(up(x)))                                   # == dense down(gelu(up(x)))
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fairscale.nn.model_parallel import mappings
from fairscale.nn.model_parallel.initialize import (MODEL_AXIS, get_model_parallel_rank,
                                                    get_model_parallel_world_size)
from passes.ops import comm

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelEmbedding",
           "divide", "vocab_range", "_initialize_affine_weight"]

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the model-parallel size {denominator}")
    return numerator // denominator


def vocab_range(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """[first, last) vocabulary ids held by ``rank``."""
    per = divide(vocab, world)
    return rank * per, (rank + 1) * per


def _slice_master(master: torch.Tensor, dim: int, stride: int) -> torch.Tensor:
    """This rank's slice of ``master`` along ``dim``; with ``stride`` > 1 the dim is cut in
    ``stride × world`` blocks and the rank takes every ``world``-th one (fused QKV layouts)."""
    world, rank = get_model_parallel_world_size(), get_model_parallel_rank()
    blocks = master.chunk(stride * world, dim=dim) if master.shape[dim] % (stride * world) == 0 else None
    if blocks is None:
        raise ValueError(f"dim {dim} of size {master.shape[dim]} does not split into stride({stride}) × "
                         f"model_parallel({world}) blocks")
    return torch.cat(blocks[rank::world], dim=dim).contiguous()


def _master(rows: int, cols: int, init_method: InitMethod, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense weight, initialized on the host (identical on every rank seeded alike)."""
    # lint: cpu -- the host generator, seeded alike on every rank (CUDA seeds differ per model-parallel rank)
    master = torch.empty(rows, cols, dtype=dtype, device="cpu")
    init_method(master)
    return master


def _initialize_affine_weight(weight: torch.Tensor, out_features: int, in_features: int, per_partition_size: int,
                              partition_dim: int, init_method: InitMethod, stride: int = 1,
                              return_master_weight: bool = False) -> torch.Tensor | None:
    """Fill ``weight`` with this rank's slice (along ``partition_dim``) of a dense
    ``(out_features, in_features)`` weight initialized by ``init_method`` (FairScale's helper,
    which its layers and tests use). With one model-parallel rank, ``weight`` is initialized directly."""
    if get_model_parallel_world_size() == 1:
        init_method(weight)
        return weight if return_master_weight else None
    master = _master(out_features, in_features, init_method, weight.dtype)
    mine = _slice_master(master, partition_dim, stride)
    if mine.shape[partition_dim] != per_partition_size:
        raise ValueError(f"per_partition_size={per_partition_size} but this rank's slice has "
                         f"{mine.shape[partition_dim]} along dim {partition_dim}")
    with torch.no_grad():
        weight.copy_(mine)
    return master if return_master_weight else None


class ColumnParallelLinear(nn.Module):
    """``Y = XAᵀ + b`` with ``A`` split by output features (rows of ``weight``).

    Args:
        in_features, out_features: the dense layer's sizes.
        bias: add a (split) bias, initialized to zero.
        gather_output: all-gather the output so every rank holds all ``out_features``; otherwise
            each rank returns its ``out_features / world`` slice.
        init_method: initializes the full master weight (default ``xavier_normal_``).
        stride: interleaved split for fused projections.
        keep_master_weight_for_test: keep the dense master weight as ``self.master_weight``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = True,
                 init_method: InitMethod = nn.init.xavier_normal_, stride: int = 1,
                 keep_master_weight_for_test: bool = False) -> None:
        super().__init__()
        world = get_model_parallel_world_size()
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.output_size_per_partition = divide(out_features, world)
        master = _master(out_features, in_features, init_method)
        device = torch.get_default_device()
        self.weight = nn.Parameter(_slice_master(master, 0, stride).to(device))
        self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, device=device)) if bias else None
        if bias:
            self.bias.model_parallel = True  # type: ignore[union-attr]
        self.weight.model_parallel = True  # type: ignore[attr-defined]
        self.master_weight = master if keep_master_weight_for_test else None

    def get_master_weight(self) -> torch.Tensor:
        """The full weight, gathered from every rank."""
        return comm.gather_from_group(self.weight.detach().t(), MODEL_AXIS, -1).t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = mappings.copy_to_model_parallel_region(x)
        y = F.linear(x, self.weight, self.bias)
        return mappings.gather_from_model_parallel_region(y) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``Y = XAᵀ + b`` with ``A`` split by input features (columns of ``weight``).

    Args:
        in_features, out_features: the dense layer's sizes.
        bias: add a full bias after the all-reduce, initialized to zero.
        input_is_parallel: the input is already split along its last dim (e.g. the output of a
            ``ColumnParallelLinear(gather_output=False)``); otherwise it is split here.
        init_method, stride, keep_master_weight_for_test: as :class:`ColumnParallelLinear`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = False,
                 init_method: InitMethod = nn.init.xavier_normal_, stride: int = 1,
                 keep_master_weight_for_test: bool = False) -> None:
        super().__init__()
        world = get_model_parallel_world_size()
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.input_size_per_partition = divide(in_features, world)
        master = _master(out_features, in_features, init_method)
        device = torch.get_default_device()
        self.weight = nn.Parameter(_slice_master(master, 1, stride).to(device))
        self.weight.model_parallel = True  # type: ignore[attr-defined]
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self.master_weight = master if keep_master_weight_for_test else None

    def get_master_weight(self) -> torch.Tensor:
        return comm.gather_from_group(self.weight.detach(), MODEL_AXIS, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = mappings.scatter_to_model_parallel_region(x)
        y = mappings.reduce_from_model_parallel_region(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split across ranks: each rank looks up the ids it holds,
    zeros the others, and the partial results are summed (all-reduce).

    Args:
        num_embeddings, embedding_dim: the dense table's size.
        padding_idx: as ``nn.Embedding``: that row gets no gradient (its rank holds it).
        init_method: initializes the full master table (default ``xavier_normal_``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 init_method: InitMethod = nn.init.xavier_normal_, keep_master_weight_for_test: bool = False) -> None:
        super().__init__()
        world, rank = get_model_parallel_world_size(), get_model_parallel_rank()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.vocab_start_index, self.vocab_end_index = vocab_range(num_embeddings, rank, world)
        master = _master(num_embeddings, embedding_dim, init_method)
        self.weight = nn.Parameter(master[self.vocab_start_index:self.vocab_end_index].to(torch.get_default_device(),
                                                                                           copy=True))
        self.weight.model_parallel = True  # type: ignore[attr-defined]
        self._local_padding = (padding_idx - self.vocab_start_index
                               if padding_idx is not None and self.vocab_start_index <= padding_idx < self.vocab_end_index
                               else None)
        self.master_weight = master if keep_master_weight_for_test else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self._local_padding)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return mappings.reduce_from_model_parallel_region(out)


class ParallelEmbedding(nn.Module):
    """Embedding with the *embedding dimension* split across ranks (all-gather of the output)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 init_method: InitMethod = nn.init.xavier_normal_, keep_master_weight_for_test: bool = False) -> None:
        super().__init__()
        world = get_model_parallel_world_size()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.embedding_dim_per_partition = divide(embedding_dim, world)
        master = _master(num_embeddings, embedding_dim, init_method)
        self.weight = nn.Parameter(_slice_master(master, 1, 1).to(torch.get_default_device()))
        self.weight.model_parallel = True  # type: ignore[attr-defined]
        self.master_weight = master if keep_master_weight_for_test else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return mappings.gather_from_model_parallel_region(F.embedding(ids, self.weight, self.padding_idx))
