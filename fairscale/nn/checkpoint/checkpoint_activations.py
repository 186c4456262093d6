"""checkpoint_wrapper: recompute a module's forward during backward instead of keeping its activations.

    from fairscale.nn.checkpoint import checkpoint_wrapper

    block = checkpoint_wrapper(block, offload_to_cpu=True)   # same module object, same state_dict keys

As in FairScale, the module is returned itself with its instance ``forward`` replaced, so parameter
names and state_dict keys do not change and it composes with FSDP either way round
(``FSDP(checkpoint_wrapper(m))`` or ``checkpoint_wrapper(FSDP(m))``).

Mechanism: PyTorch's non-reentrant ``torch.utils.checkpoint`` (keyword arguments, non-tensor
outputs, inputs that do not require grad; the RNG state is restored, so dropout recomputes the same
mask). Only the module's inputs are kept; every tensor the forward would have saved for backward is
dropped and recomputed, and only if a gradient flows through the output (a module whose
parameters and inputs need no gradient runs once). With ``offload_to_cpu=True`` the kept inputs
are stored on the CPU and copied back to their device for the recomputation.

Batch norm: the recomputation does not update running statistics again, so ``running_mean``,
``running_var`` and ``num_batches_tracked`` advance once per forward, as without checkpointing
(FairScale 0.4.13 patches batch-norm layers for the same reason; a layer with a
``disable_patch_batchnorm`` attribute is left alone and updates on both passes, as there).

``torch.no_grad()`` or the :func:`disable_checkpointing` context run the module plainly.
:func:`is_checkpointing` / :func:`is_recomputing` tell a layer which of the two passes it is in.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["checkpoint_wrapper", "disable_checkpointing", "enable_checkpointing", "enable_recomputing",
           "is_checkpointing", "is_recomputing", "is_checkpointing_disabled"]


class _State(threading.local):
    checkpointing = False
    recomputing = False
    disabled = False


_STATE = _State()


@contextlib.contextmanager
def _flag(name: str) -> Iterator[None]:
    old = getattr(_STATE, name)
    setattr(_STATE, name, True)
    try:
        yield
    finally:
        setattr(_STATE, name, old)


def disable_checkpointing() -> contextlib.AbstractContextManager[None]:
    """Inside this context, checkpointed modules run plainly (keep their activations)."""
    return _flag("disabled")


def enable_checkpointing() -> contextlib.AbstractContextManager[None]:
    """Marks a checkpointed module's first forward (:func:`is_checkpointing` is True inside)."""
    return _flag("checkpointing")


def enable_recomputing() -> contextlib.AbstractContextManager[None]:
    """Marks a checkpointed module's recomputation in backward (:func:`is_recomputing` is True inside)."""
    return _flag("recomputing")


def is_checkpointing() -> bool:
    """True while a checkpointed forward runs for the first time."""
    return _STATE.checkpointing


def is_recomputing() -> bool:
    """True while a checkpointed forward is being recomputed during backward: use it to skip side
    effects that must happen once (counters, running statistics)."""
    return _STATE.recomputing


def is_checkpointing_disabled() -> bool:
    """True inside :func:`disable_checkpointing`."""
    return _STATE.disabled


@contextlib.contextmanager
def _frozen_running_stats(module: nn.Module) -> Iterator[None]:
    """Batch-norm layers of ``module`` in training mode update scratch copies of their running
    statistics, thrown away afterwards (the recomputation would otherwise update them twice). The
    kernel still receives running buffers, so it saves the same tensors for backward as the first
    pass did, which the non-reentrant checkpoint checks."""
    frozen = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats
              and not hasattr(m, "disable_patch_batchnorm")]
    kept = []
    for m in frozen:
        count = m.num_batches_tracked.clone() if m.num_batches_tracked is not None else None
        kept.append((m.running_mean, m.running_var, count))
        m.running_mean = m.running_mean.clone() if m.running_mean is not None else None
        m.running_var = m.running_var.clone() if m.running_var is not None else None
    try:
        yield
    finally:
        for m, (mean, var, count) in zip(frozen, kept):
            m.running_mean, m.running_var = mean, var
            if count is not None:
                m.num_batches_tracked.copy_(count)


def _to_cpu(x: Any) -> Any:
    return x.to("cpu") if isinstance(x, torch.Tensor) else x


def _checkpointed_forward(original: Callable[..., Any], module_ref: Any, offload_to_cpu: bool,
                          *args: Any, **kwargs: Any) -> Any:
    module = module_ref()
    if module is None:
        raise RuntimeError("checkpoint_wrapper: the wrapped module was garbage-collected")
    if not torch.is_grad_enabled() or _STATE.disabled:
        return original(module, *args, **kwargs)
    devices = [a.device if isinstance(a, torch.Tensor) else None for a in args]
    passes = [0]

    def run(*inputs: Any) -> Any:
        passes[0] += 1
        if offload_to_cpu:  # back to where the caller had them, differentiably
            inputs = tuple(x.to(d) if d is not None else x for x, d in zip(inputs, devices))
        if passes[0] == 1:
            with enable_checkpointing():
                return original(module, *inputs, **kwargs)
        with enable_recomputing(), _frozen_running_stats(module):
            return original(module, *inputs, **kwargs)

    kept = tuple(_to_cpu(a) for a in args) if offload_to_cpu else args
    return torch.utils.checkpoint.checkpoint(run, *kept, use_reentrant=False)


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
