"""Tensor-parallel compute ops that ``shard_tensor_parallel_pass`` calls from rank graphs.

Each is a plain function of tensors and constants, so a printed rank graph reads, e.g.,
``vocab_parallel_cross_entropy(to_16, reshape_9, 'tp', 64, -100, 1)``. The collectives they run
record into :data:`passes.ops.comm.COUNTER` like every other collective.

* :func:`vocab_parallel_embedding` - lookup in a vocab-sharded table: ids outside this rank's range
  read row 0 and are zeroed, so the output is a partial sum (Megatron-LM,
  ``VocabParallelEmbedding``; Shoeybi et al. 2019). No communication; the pass inserts the
  all-reduce (or the reduce-scatter under sequence parallelism).
* :func:`vocab_parallel_cross_entropy` - cross-entropy of vocab-sharded logits without gathering
  them: an all-reduce(max) of [N] and one all-reduce(sum) of [2, N] (sum of exp and target logit;
  [3, N] with label smoothing, which also needs the sum of the logits). Megatron-LM
  ``_VocabParallelCrossEntropy`` (which uses three all-reduces; the sums are fused here).
* :func:`sharded_dropout` - dropout of a tensor-parallel shard with a mask stream of its own per
  tp rank (Megatron's model-parallel RNG region), while the shared stream advances alike on
  every rank so replicated dropouts stay identical.
* :func:`local_chunk` - this rank's chunk of a replicated value whose gradient is all-reduced
  upstream (by a ``copy_to_group``): backward pads the chunk's gradient with zeros into a partial
  sum instead of all-gathering it (``passes.tp.fuse.hoist_copy_over_scatter``). No communication.
* :func:`expert_grouped_mm` - the expert-parallel form of ``transformers::grouped_mm_fallback``:
  rows are sorted by expert, and this rank multiplies only the rows of its own experts, leaving
  zeros elsewhere (a disjoint partial sum).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from passes.ops import comm
from passes.ops.groups import group_function

__all__ = ["vocab_parallel_embedding", "vocab_parallel_cross_entropy", "expert_grouped_mm", "sharded_dropout",
           "local_chunk"]


def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, vocab_start: int,
                             padding_idx: int = -1) -> torch.Tensor:
    """Rows ``ids`` of the full table whose rows ``[vocab_start, vocab_start + weight.shape[0])``
    this rank holds; ids outside that range give zeros. ``padding_idx`` is the global padding
    row (its gradient stays zero, as in ``nn.Embedding``)."""
    rows = weight.shape[0]
    outside = (ids < vocab_start) | (ids >= vocab_start + rows)
    local = (ids - vocab_start).masked_fill(outside, 0)
    local_pad = padding_idx - vocab_start if 0 <= padding_idx - vocab_start < rows else -1
    out = torch.ops.aten.embedding.default(weight, local, local_pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


@group_function
class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, axis: str, vocab_start: int,
                ignore_index: int, reduction: int, smoothing: float) -> torch.Tensor:
        x = logits if logits.dtype == torch.float64 else logits.float()
        gmax = x.max(dim=-1).values
        comm.all_reduce_(gmax, axis, op=dist.ReduceOp.MAX)
        shifted = x - gmax.unsqueeze(-1)
        exp = shifted.exp()
        rows = x.shape[-1]
        inside = (target >= vocab_start) & (target < vocab_start + rows)
        local_t = (target - vocab_start).masked_fill(~inside, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        parts = [exp.sum(dim=-1), picked] + ([shifted.sum(dim=-1)] if smoothing else [])
        sums = torch.stack(parts)
        comm.all_reduce_(sums, axis)
        sum_exp, target_logit = sums[0], sums[1]
        valid = target != ignore_index
        log_z = sum_exp.log()
        loss = log_z - target_logit
        vocab = rows * comm.group_size(axis)
        if smoothing:  # PyTorch's label smoothing: (1-e)·nll + e·mean over the vocabulary of -log p
            loss = (1.0 - smoothing) * loss + smoothing * (log_z - sums[2] / vocab)
        loss = loss.masked_fill(~valid, 0.0)
        count = valid.sum()
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local_t, inside, valid, count)
        ctx.reduction, ctx.dtype, ctx.smoothing, ctx.vocab = reduction, logits.dtype, smoothing, vocab
        if reduction == 0:
            return loss.to(logits.dtype)
        total = loss.sum()
        return (total / count if reduction == 1 else total).to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, local_t, inside, valid, count = ctx.saved_tensors
        eps = ctx.smoothing
        hit = torch.zeros_like(softmax).scatter_(-1, local_t.unsqueeze(-1), inside.unsqueeze(-1).to(softmax.dtype))
        g = softmax - (1.0 - eps) * hit - eps / ctx.vocab if eps else softmax - hit
        g = g * valid.unsqueeze(-1).to(g.dtype)
        if ctx.reduction == 0:
            g = g * grad.unsqueeze(-1)
        elif ctx.reduction == 1:
            g = g * (grad / count)
        else:
            g = g * grad
        return g.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, axis: str, vocab_start: int,
                                 ignore_index: int = -100, reduction: int = 1,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy(full_logits, target, ignore_index=, label_smoothing=)`` from this rank's
    vocab columns ``logits`` [N, V/tp].

    ``reduction`` uses aten's codes: 0 none, 1 mean (over targets != ignore_index), 2 sum. With
    label smoothing ``e`` the loss of a row is ``(1-e)·(log Z - x_t) + e·(log Z - sum_v x_v / V)``
    (PyTorch's definition), so a third sum (of the logits) joins the all-reduce.
    """
    if logits.dim() != 2:
        raise ValueError(f"vocab_parallel_cross_entropy takes [N, V/tp] logits, got shape {tuple(logits.shape)}")
    return _VocabParallelCE.apply(logits, target, axis, vocab_start, ignore_index, reduction, float(label_smoothing))


def expert_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, expert_start: int) -> torch.Tensor:
    """``grouped_mm_fallback(x, full_weight, offsets)`` restricted to this rank's experts.

    ``x`` [T, K] rows are sorted by expert; ``offsets`` [E] is the running end row of each expert;
    ``weight`` [E/tp, K, N] holds experts ``[expert_start, expert_start + E/tp)``. Rows of other
    experts come out as zeros.
    """
    local = weight.shape[0]
    lo = int(offsets[expert_start - 1]) if expert_start > 0 else 0
    hi = int(offsets[expert_start + local - 1])
    # always call the op, even on zero rows, so the local experts get a (zero) gradient like the
    # single-process run and the optimizer updates them the same way
    part = torch.ops.transformers.grouped_mm_fallback.default(
        x[lo:hi], weight, (offsets[expert_start:expert_start + local] - lo).to(offsets.dtype))
    n = weight.shape[-1]
    return torch.cat([x.new_zeros((lo, n)), part, x.new_zeros((x.shape[0] - hi, n))], dim=0)


def sharded_dropout(x: torch.Tensor, p: float, train: bool, tp_index: int) -> torch.Tensor:
    """``dropout(x, p, train)`` for a shard ``x``: every tp rank draws one seed from the default
    generator (so all ranks advance it equally and replicated regions keep matching masks), then
    masks its shard from a generator seeded by that seed and its ``tp_index`` (independent masks
    across shards; Megatron-LM's ``model_parallel_cuda_manual_seed`` offsets by tp rank the same way)."""
    if not train or p == 0.0:
        return x.clone()
    if p == 1.0:
        return x * 0.0
    # lint: cpu -- drawn from the default host generator, which every rank advances alike (no device sync)
    seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
    gen = torch.Generator(device=x.device).manual_seed((seed + 2718281 * (tp_index + 1)) % 2**63)
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=gen)
    return x * keep / (1.0 - p)


@group_function
class _LocalChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
        n, r = comm.group_size(axis), comm.group_rank(axis)
        dim = dim % x.dim()
        if x.shape[dim] % n:
            raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {n} ranks of axis {axis!r}")
        ctx.shape, ctx.dim, ctx.start = x.shape, dim, r * (x.shape[dim] // n)
        return x.narrow(dim, ctx.start, x.shape[dim] // n).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        full = grad.new_zeros(ctx.shape)
        full.narrow(ctx.dim, ctx.start, grad.shape[ctx.dim]).copy_(grad)
        return full, None, None


def local_chunk(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """Chunk ``group_rank(axis)`` of ``x`` along ``dim``; the gradient comes back as that chunk in
    zeros of ``x``'s shape (a partial sum, to be all-reduced by a ``copy_to_group`` in front)."""
    return _LocalChunk.apply(x, axis, dim)
