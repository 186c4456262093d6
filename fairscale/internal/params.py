"""Parameter and collective helpers: global ranks, copies to a device, gradient norms."""

from __future__ import annotations

import collections.abc as abc
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

__all__ = ["Workhandle", "get_global_rank", "recursive_copy_to_device", "calc_grad_norm"]


@dataclass
class Workhandle:
    """An asynchronous collective's handle and what to run once it completed."""

    handle: Any
    callback: Callable[[], None] | None = None


def get_global_rank(group: Any, rank: int) -> int:
    """The world rank of ``group``'s local ``rank`` (the identity for the world group)."""
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def recursive_copy_to_device(value: Any, non_blocking: bool, device: torch.device) -> Any:
    """A copy of ``value`` with every tensor in its lists, tuples and mappings moved to ``device``.

    Containers are rebuilt (lists stay lists, tuples tuples, mappings become dicts); other values
    are returned as they are. Two references to one tensor become two copies.
    """
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, (list, tuple)):
        items = [recursive_copy_to_device(v, non_blocking=non_blocking, device=device) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, abc.Mapping):
        return {k: recursive_copy_to_device(v, non_blocking=non_blocking, device=device) for k, v in value.items()}
    return value


def calc_grad_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, p: float) -> torch.Tensor:
    """The ``p``-norm of all gradients of ``parameters`` as one vector (``0.`` when none has one).

    Each gradient's norm is taken in float32 whatever its dtype; the total is returned in the
    first gradient's parameter dtype, as FairScale did.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    params = [q for q in params if q.grad is not None]
    if not params:
        return torch.tensor(0.0, device=torch.get_default_device())  # no gradient anywhere: a host-side zero
    p = float(p)
    if p == math.inf:
        return torch.stack([q.grad.detach().abs().max() for q in params]).max()  # type: ignore[union-attr]
    norms = torch.stack([torch.linalg.vector_norm(q.grad.detach(), p, dtype=torch.float32)  # type: ignore[union-attr]
                         for q in params])
    return torch.linalg.vector_norm(norms, p).to(params[0].dtype)
