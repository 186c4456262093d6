"""GShard mixture-of-experts layer with expert parallelism (FairScale 0.4.13's ``MOELayer``).

Each rank holds ``len(experts)`` local experts; with ``n`` ranks there are ``E = n · local``
experts, numbered rank-major (rank r holds experts ``r·local … r·local + local − 1``). Per step::

    tokens (S, M) ─gate─► dispatch (E, C, M) ─all-to-all─► (n, local, C, M) per rank
        ─local experts─► (n, local, C, M) ─all-to-all─► (E, C, M) ─combine─► (S, M)

The gate is replicated (train it with data parallelism); each expert's parameters live on one rank
and receive gradient from every rank's tokens through the backward all-to-all.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fairscale.optim.oss import axis_for_group
from passes.ops import comm

__all__ = ["MOELayer"]


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its gradient is the reverse all-to-all (same splits)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: str) -> torch.Tensor:
        ctx.axis = axis
        x = x.contiguous()
        out = torch.empty_like(x)
        comm.all_to_all_single(out, x, axis)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        comm.all_to_all_single(out, grad, ctx.axis)
        return out, None


class MOELayer(nn.Module):
    """Route tokens through ``gate`` to ``experts`` spread over ``group``.

    Args:
        gate: returns ``(l_aux, combine_weights, dispatch_mask)``, e.g. :class:`Top2Gate` with
            ``num_experts = world_size(group) × len(experts)``.
        experts: this rank's experts (a module or a ``ModuleList``); each maps (tokens, M) → (tokens, M).
        group: the expert-parallel process group (default: the world, or a single process when
            torch.distributed is not initialized).

    ``forward(x)`` takes (..., M) and returns the same shape; the load-balancing loss of the last
    call is in ``self.l_aux``.
    """

    def __init__(self, gate: nn.Module, experts: nn.Module | nn.ModuleList, group: Any = None) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts if isinstance(experts, nn.ModuleList) else nn.ModuleList([experts])
        for p in self.experts.parameters():
            p.expert = True  # type: ignore[attr-defined]  # FairScale's marker: not data-parallel
        self.group = group
        self.axis = axis_for_group(group, prefix="moe") if dist.is_initialized() else "moe:local"
        self.world_size = comm.group_size(self.axis)
        self.num_local_experts = len(self.experts)
        self.l_aux: torch.Tensor | None = None

    def forward(self, *inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if len(inputs) != 1 or kwargs:
            raise ValueError("MOELayer.forward takes exactly one tensor (tokens, ..., model_dim)")
        x = inputs[0]
        model_dim = x.shape[-1]
        tokens = x.reshape(-1, model_dim)
        self.l_aux, combine, dispatch = self.gate(tokens)
        experts = combine.shape[1]
        if experts != self.world_size * self.num_local_experts:
            raise ValueError(f"the gate routes to {experts} experts, but world_size({self.world_size}) × "
                             f"local experts({self.num_local_experts}) = {self.world_size * self.num_local_experts}")
        dispatched = torch.einsum("sec,sm->ecm", dispatch.to(tokens.dtype), tokens)
        capacity = dispatched.shape[1]
        dispatched = _AllToAll.apply(dispatched, self.axis)
        # (n·local, C, M) from every rank -> per local expert, the slots sent by all n ranks
        chunks = dispatched.reshape(self.world_size, self.num_local_experts, capacity, model_dim)
        # each expert sees (ranks, 1, C, M), the shape FairScale hands it
        outs = [expert(chunks[:, i:i + 1]) for i, expert in enumerate(self.experts)]
        expert_out = torch.cat([o.reshape(self.world_size, 1, capacity, model_dim) for o in outs], dim=1)
        expert_out = _AllToAll.apply(expert_out.reshape(experts, capacity, model_dim), self.axis)
        combined = torch.einsum("sec,ecm->sm", combine.to(tokens.dtype), expert_out)
        return combined.reshape(x.shape)
