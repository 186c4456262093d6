"""checkpoint_wrapper: recompute a module's forward during backward instead of keeping its activations.

    from fairscale.nn.checkpoint import checkpoint_wrapper

    block = checkpoint_wrapper(block, offload_to_cpu=True)   # same module object, same state_dict keys

As in FairScale, the module is returned itself with its instance ``forward`` replaced, so parameter
names and state_dict keys do not change and it composes with FSDP either way round
(``FSDP(checkpoint_wrapper(m))`` or ``checkpoint_wrapper(FSDP(m))``).

Mechanism: PyTorch's non-reentrant ``torch.utils.checkpoint`` (supports keyword arguments,
non-tensor outputs and inputs that do not require grad). Only the module's inputs are kept; every
tensor the forward would have saved for backward is dropped and recomputed. With
``offload_to_cpu=True`` the kept inputs are stored on the CPU and copied back to their device for
the recomputation; on a CPU-only machine that copy is the identity.

Checkpointing applies only when autograd records the forward (``torch.is_grad_enabled()``); under
``torch.no_grad()`` the module runs plainly.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = ["checkpoint_wrapper", "is_checkpointing", "is_recomputing"]

_STATE = threading.local()


def is_checkpointing() -> bool:
    """True while a checkpointed forward runs for the first time."""
    return getattr(_STATE, "depth", 0) > 0 and not is_recomputing()


def is_recomputing() -> bool:
    """True while a checkpointed forward is being recomputed during backward."""
    return torch._C._current_graph_task_id() != -1


def _to_cpu(x: Any) -> Any:
    return x.to("cpu") if isinstance(x, torch.Tensor) else x


def _checkpointed_forward(original: Callable[..., Any], module_ref: Any, offload_to_cpu: bool,
                          *args: Any, **kwargs: Any) -> Any:
    module = module_ref()
    if module is None:
        raise RuntimeError("checkpoint_wrapper: the wrapped module was garbage-collected")
    if not torch.is_grad_enabled():
        return original(module, *args, **kwargs)
    devices = [a.device if isinstance(a, torch.Tensor) else None for a in args]

    def run(*inputs: Any) -> Any:
        if offload_to_cpu:  # back to where the caller had them, differentiably
            inputs = tuple(x.to(d) if d is not None else x for x, d in zip(inputs, devices))
        return original(module, *inputs, **kwargs)

    kept = tuple(_to_cpu(a) for a in args) if offload_to_cpu else args
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        return torch.utils.checkpoint.checkpoint(run, *kept, use_reentrant=False)
    finally:
        _STATE.depth -= 1


def _unbound_forward(module: nn.Module) -> Callable[..., Any]:
    """The forward to checkpoint, as a function of (module, *args): an instance-level forward that
    someone already patched in, or the class's."""
    inst = module.__dict__.get("forward")
    if inst is None:
        return type(module).forward
    return lambda _m, *a, **k: inst(*a, **k)


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """Checkpoint ``module``'s activations; returns ``module`` itself.

    Args:
        module: the module whose forward to recompute during backward.
        offload_to_cpu: keep the checkpointed inputs on the CPU between forward and backward.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_wrapper expects an nn.Module, got {type(module).__name__}")
    original = _unbound_forward(module)
    # a weak reference: a strong one from the instance's own __dict__ would be a reference cycle
    module.forward = functools.partial(_checkpointed_forward, original, weakref.ref(module), bool(offload_to_cpu))
    module._checkpoint_offload_to_cpu = bool(offload_to_cpu)  # type: ignore[assignment]
    return module
