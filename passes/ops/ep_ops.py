"""Runtime ops of expert parallelism: token dispatch and combine by all-to-all on the ``ep`` axis.

The expert-parallel pass (:mod:`passes.ep.shard_experts`) calls these from a rank's graph around the
expert computation of a mixture-of-experts layer (GShard, Lepikhin et al. 2020, section 2.2;
DeepSpeed-MoE, Rajbhandari et al. 2022). Each of the ``n`` ranks of an ``ep`` group holds ``E/n``
consecutive experts and its own tokens; the rows handed to :func:`moe_dispatch` are this rank's
(token, expert) pairs sorted by expert, and ``offsets`` is the running end row of each of the ``E``
experts (Hugging Face's ``grouped_mm`` layout)::

    moe_dispatch   all-gather the per-expert row counts (E integers per rank), then all-to-all the
                   rows to the rank owning their expert; regroup the received rows by local expert
                   and return them with the local offsets                      backward: all-to-all back
    moe_combine    undo the regrouping, all-to-all the expert outputs back to the rows' source rank,
                   in the order they left                                      backward: all-to-all out

Both are exact: rows are moved, never summed, so the experts see exactly the rows a single process
would give them, and every output row comes back to its place. The counter records the bytes a rank
sends to other ranks (its own rows stay put).

Host syncs: ``all_to_all_single`` takes its split sizes as host integers, so each dispatch copies the
``[n, E]`` routing table to the host once (one device sync per MoE layer per forward, as in
DeepSpeed-MoE and Megatron-LM's token dispatchers). Everything derived from it (split sizes, the
regrouping index, local offsets) is computed on the host from that copy and sent back with
asynchronous copies; :func:`moe_combine` reuses the host table and never syncs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from passes.ops import comm
from passes.ops.groups import group_function

__all__ = ["moe_dispatch", "moe_combine", "scale_grad", "regroup_order"]


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], axis: str) -> torch.Tensor:
    """Rows ``x`` split by ``send`` go to the ranks in order; rows from each rank arrive by ``recv``."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    row = x[0].numel() * x.element_size() if x.dim() > 1 else x.element_size()
    me = comm.group_rank(axis)
    comm.count("all_to_all", axis, x.numel() * x.element_size(), float((sum(send) - send[me]) * row))
    group = comm.get_group(axis)
    comm.traced("all_to_all", axis, x, lambda: dist.all_to_all_single(out, x, output_split_sizes=recv,
                                                                       input_split_sizes=send, group=group))
    return out


@group_function
class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], axis: str) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.axis = send, recv, axis
        return _all_to_all(x, send, recv, axis)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.axis), None, None, None


@group_function
class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity forward; multiplies the gradient by ``scale`` in backward."""
    return _ScaleGrad.apply(x, scale)


def _route(offsets: torch.Tensor, axis: str) -> torch.Tensor:
    """Every ep rank's row count per expert, ``[n, E]`` int64 on the host (one tiny all-gather on
    the device, then the layer's one host copy)."""
    ends = offsets.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    n = comm.group_size(axis)
    if n == 1:
        return counts.unsqueeze(0).cpu()
    out = counts.new_empty(n * counts.numel())
    comm.all_gather_flat(out, counts, axis)
    return out.view(n, -1).cpu()


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``, copied without blocking (from pinned memory on CUDA)."""
    if t.device == device:
        return t
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


def _plan(route: torch.Tensor, axis: str) -> tuple[list[int], list[int], torch.Tensor | None]:
    """(rows this rank sends to each rank, rows it receives from each rank, the index that regroups
    received rows, ordered by source then expert, into expert then source order; None if it is the
    identity)."""
    n, experts = route.shape
    me, local = comm.group_rank(axis), experts // n
    send = route[me].view(n, local).sum(1).tolist()
    mine = route[:, me * local:(me + 1) * local]  # [source rank, local expert]
    recv = mine.sum(1).tolist()
    if n == 1 or local == 1:
        return send, recv, None
    return send, recv, regroup_order(mine)


def regroup_order(counts: torch.Tensor) -> torch.Tensor:
    """Row index that reorders rows received as blocks ``(source, expert)`` in source-major order
    (block sizes ``counts[source, expert]``) into expert-major order, keeping each block's rows in
    order: ``cat(arange(start[s, e], start[s, e] + counts[s, e]) for e for s)``."""
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(counts)  # where block (s, e) begins as received
    sizes, firsts = counts.t().reshape(-1), starts.t().reshape(-1)  # the blocks in (expert, source) order
    # lint: cpu -- counts are the routing table's host copy: host ops, no device sync
    offset_in_block = torch.arange(int(sizes.sum()), device="cpu") - \
        torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    return torch.repeat_interleave(firsts, sizes) + offset_in_block


def moe_dispatch(rows: torch.Tensor, offsets: torch.Tensor, axis: str,
                 num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Send this rank's expert-sorted ``rows`` to the ranks owning their experts.

    Args:
        rows: ``[S, K]`` (token, expert) rows sorted by expert.
        offsets: ``[E]`` running end row of each expert in ``rows`` (int32 or int64).
        axis: the expert-parallel comm axis; rank ``i`` of ``n`` owns experts ``[i*E/n, (i+1)*E/n)``.
        num_experts: ``E`` (checked against ``offsets``).

    Returns:
        ``(grouped, local_offsets, route)``: the received rows grouped by local expert, the running
        end row of each local expert (``offsets``' dtype and device), and every rank's per-expert
        row counts ``[n, E]``, on the host, for :func:`moe_combine`.
    """
    if offsets.numel() != num_experts:
        raise ValueError(f"moe_dispatch: offsets has {offsets.numel()} entries for {num_experts} experts")
    n = comm.group_size(axis)
    if num_experts % n:
        raise ValueError(f"moe_dispatch: {num_experts} experts do not split over {n} ranks of axis {axis!r}")
    route = _route(offsets, axis)
    send, recv, order = _plan(route, axis)
    got = _AllToAll.apply(rows, send, recv, axis) if n > 1 else rows
    grouped = got if order is None else got[_to(order, got.device)]
    me, local = comm.group_rank(axis), num_experts // n
    local_offsets = torch.cumsum(route[:, me * local:(me + 1) * local].sum(0), 0).to(offsets.dtype)
    return grouped, _to(local_offsets, offsets.device), route


def moe_combine(out: torch.Tensor, route: torch.Tensor, axis: str) -> torch.Tensor:
    """Return expert outputs ``out`` (grouped as :func:`moe_dispatch` gave them) to their source
    ranks, in the order the rows left."""
    if comm.group_size(axis) == 1:
        return out
    send, recv, order = _plan(route, axis)
    if order is not None:
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        out = out[_to(inverse, out.device)]
    return _AllToAll.apply(out, recv, send, axis)
