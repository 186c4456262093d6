"""Cross-entropy over vocabulary-parallel logits, without gathering them.

Megatron-LM (Shoeybi et al. 2019, section 3, "parallel cross entropy"): with logits ``z`` split by
vocabulary across ranks, per token::

    m = max_v z_v                 (all-reduce MAX of the local maxima)
    Z = Σ_v exp(z_v − m)          (all-reduce SUM of local sums)
    z_t − m                       (only the rank holding target t contributes; all-reduce SUM)
    loss = log Z − (z_t − m)

and the gradient on each rank is ``softmax(z)_local − onehot(t)_local``, times the upstream grad.
Only per-token scalars cross the wire: 3 all-reduces of ``tokens`` elements.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fairscale.nn.model_parallel.initialize import MODEL_AXIS, get_model_parallel_rank, get_model_parallel_world_size
from fairscale.nn.model_parallel.layers import vocab_range
from passes.ops import comm

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        comm.all_reduce_(local_max, MODEL_AXIS, op=dist.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)
        part = shifted.shape[-1]
        start, end = vocab_range(part * get_model_parallel_world_size(), get_model_parallel_rank(),
                                 get_model_parallel_world_size())
        outside = (target < start) | (target >= end)
        local_t = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce_(picked, MODEL_AXIS)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        comm.all_reduce_(total, MODEL_AXIS)
        loss = total.log() - picked
        softmax = exp.div_(total.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        softmax, local_t, outside = ctx.saved_tensors
        g = softmax.clone()
        onehot = torch.zeros_like(g).scatter_(-1, local_t.unsqueeze(-1), 1.0)
        g -= onehot * (~outside).unsqueeze(-1).to(g.dtype)
        return g * grad.unsqueeze(-1), None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy (no reduction, shape of ``target``) of vocabulary-split logits.

    ``vocab_parallel_logits[..., v]`` holds this rank's slice of the vocabulary, e.g. the output of
    ``ColumnParallelLinear(dim, vocab, gather_output=False)``.
    """
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target)
