"""Per-layer costs for automatic balancing: wall time, or memory (parameters + saved activations).

Layers are profiled in a sandbox: a copy of each layer, on the profiling device, in training
mode. The model itself is left as it was (its BatchNorm statistics, mode, device, and gradients).
Layers receive what ``nn.Sequential`` would give them: the previous layer's output, a tuple as
one argument.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Iterator

import torch
from torch import nn

from fairscale.nn.pipe.microbatch import Batch

__all__ = ["layerwise_sandbox", "profile_times", "profile_sizes"]


def layerwise_sandbox(module: nn.Sequential, device: torch.device) -> Iterator[nn.Module]:
    """A copy of each layer of ``module``, on ``device`` and in training mode."""
    if not isinstance(module, nn.Sequential):
        raise TypeError("balance helpers need an nn.Sequential (the module you will give to Pipe)")
    for layer in module:
        sandboxed = copy.deepcopy(layer).to(device)
        sandboxed.train()
        yield sandboxed


def _detach(batch: Batch) -> None:
    """Cut the graph between layers: each layer's backward is profiled on its own."""
    batch[:] = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in batch)


def _check_no_grad(module: nn.Module) -> None:
    if any(p.grad is not None for p in module.parameters()):
        raise ValueError("some parameter already has gradient; call model.zero_grad(set_to_none=True) before "
                         "balancing (profiling runs backward passes on copies of the layers)")


def _to(sample: Any, device: torch.device) -> Batch:
    return Batch(sample.to(device) if torch.is_tensor(sample) else tuple(x.to(device) for x in sample))


def profile_times(module: nn.Sequential, sample: Any, *, timeout: float, device: torch.device) -> list[float]:
    """Seconds each layer spends in forward + backward on ``sample``, summed over repeated passes
    until ``timeout`` seconds have elapsed (at least one pass)."""
    _check_no_grad(module)
    layers = list(layerwise_sandbox(module, device))
    times = [0.0] * len(layers)
    begun = time.perf_counter()
    while True:
        batch = _to(sample, device)
        for i, layer in enumerate(layers):
            _detach(batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            batch = batch.call(layer)
            needs_grad = [y for y in batch if y.requires_grad]
            if needs_grad:
                torch.autograd.backward(needs_grad, [torch.ones_like(y) for y in needs_grad])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[i] += time.perf_counter() - start
        if time.perf_counter() - begun >= timeout:
            return times


def profile_sizes(module: nn.Sequential, input: Any, *, chunks: int, param_scale: float,  # noqa: A002
                  device: torch.device) -> list[float]:
    """Bytes each layer holds while training: activations it saves for backward (for one of
    ``chunks`` micro-batches) plus its parameters × ``param_scale`` (e.g. 2 for weight + grad,
    4 for Adam). Saved tensors are counted through autograd's saved-tensor hooks, so this measures
    the same thing on CPU and GPU (shared storages counted once)."""
    if chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks}")
    _check_no_grad(module)
    batch = _to(input, device)
    batch[:] = tuple(x.chunk(chunks)[0] for x in batch)
    sizes: list[float] = []
    for layer in layerwise_sandbox(module, device):
        _detach(batch)
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
            batch = batch.call(layer)
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        sizes.append(saved + params * param_scale)
    return sizes
