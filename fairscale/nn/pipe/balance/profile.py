"""Per-layer costs for automatic balancing: wall time, or memory (parameters + saved activations)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

__all__ = ["profile_times", "profile_sizes"]


def _as_tuple(x: Any) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def _detach(xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(x.detach().requires_grad_(x.is_floating_point()) for x in xs)


def _layers(module: nn.Sequential) -> list[nn.Module]:
    if not isinstance(module, nn.Sequential):
        raise TypeError("balance helpers need an nn.Sequential (the module you will give to Pipe)")
    return list(module)


def profile_times(module: nn.Sequential, sample: Any, *, timeout: float, device: torch.device) -> list[float]:
    """Seconds each layer spends in forward + backward on ``sample``, summed over repeated passes
    until ``timeout`` seconds have elapsed (at least one pass)."""
    layers = _layers(module)
    times = [0.0] * len(layers)
    was_training = module.training
    module.train()
    begun = time.perf_counter()
    try:
        while True:
            x = _detach(tuple(t.to(device) for t in _as_tuple(sample)))
            for i, layer in enumerate(layers):
                start = time.perf_counter()
                out = _as_tuple(layer(*x))
                floats = [o for o in out if o.is_floating_point() and o.requires_grad]
                if floats:
                    torch.autograd.backward(floats, [torch.ones_like(o) for o in floats])
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[i] += time.perf_counter() - start
                x = _detach(out)
            if time.perf_counter() - begun >= timeout:
                break
    finally:
        module.train(was_training)
        module.zero_grad(set_to_none=True)
    return times


def profile_sizes(module: nn.Sequential, input: Any, *, chunks: int, param_scale: float,
                  device: torch.device) -> list[float]:
    """Bytes each layer holds while training: activations it saves for backward (for one of
    ``chunks`` micro-batches) plus its parameters × ``param_scale`` (e.g. 2 for weight + grad,
    4 for Adam). Saved tensors are counted through autograd's saved-tensor hooks, so this measures
    the same thing on CPU and GPU (shared storages counted once)."""
    if chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks}")
    layers = _layers(module)
    sizes: list[float] = []
    x = _detach(tuple(t.to(device) for t in _as_tuple(input)))
    x = tuple(t.chunk(chunks)[0] for t in x)
    for layer in layers:
        seen: set[tuple[int, int]] = set()
        saved = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                saved += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _as_tuple(layer(*x))
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        sizes.append(saved + params * param_scale)
        x = _detach(out)
    return sizes
