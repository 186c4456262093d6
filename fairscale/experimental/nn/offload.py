"""OffloadModel: train an ``nn.Sequential`` larger than device memory by keeping its parameters on
an offload device (the CPU) and copying one slice at a time to the compute device.

    from fairscale.experimental.nn import OffloadModel

    model = OffloadModel(model=nn.Sequential(...), device=torch.device("cuda"),
                         offload_device=torch.device("cpu"), num_slices=3,
                         checkpoint_activation=True, num_microbatches=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)   # steps on the offload device
    loss = loss_fn(model(x.cuda()), y.cuda()); loss.backward(); opt.step()

How (ours, not FairScale's code): the layers are cut into ``num_slices`` contiguous slices of
about equal parameter count. A slice runs with ``torch.func.functional_call`` on *differentiable*
copies ``p.to(device)`` of its parameters, so gradients flow back to the offload-device
parameters through the copies. The copies are not kept for backward: a saved-tensor hook stores
a token in their place and copies the parameter to the device again when backward unpacks it.
So at most one slice's parameters sit on the device at a time, plus what backward re-copies.

* ``checkpoint_activation=True``: each slice is also activation-checkpointed, and the slice
  inputs it keeps are stored on the offload device (only boundary activations are kept at all).
* ``num_microbatches > 1``: the batch is split along dim 0 and every slice processes all
  microbatches while its parameters are on the device; outputs are concatenated. Identical to one
  batch for per-sample layers (not for BatchNorm in training mode, whose statistics are per microbatch).

When ``device`` equals ``offload_device`` (a CPU-only machine), ``p.to(device)`` is the parameter
itself: no copies, no hooks, plain training. That CPU configuration is tested for exactness; the
copy-and-token path is tested on the CPU by forcing copies (``_force_copies``); real transfers to a
GPU use the same code but are not exercised by the CPU test suite.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.utils.checkpoint
from torch import nn
from torch.func import functional_call

__all__ = ["OffloadModel"]


def _split_balanced(sizes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Cut ``sizes`` into ``parts`` contiguous non-empty ranges of about equal sum (greedy on the
    running total: range i ends where the total first reaches (i+1)/parts of the whole)."""
    n = len(sizes)
    parts = max(1, min(parts, n))
    total = sum(sizes) or n
    bounds: list[tuple[int, int]] = []
    start, acc = 0, 0.0
    weights = sizes if sum(sizes) else [1] * n
    for i in range(n):
        acc += weights[i]
        remaining_parts = parts - len(bounds) - 1
        if remaining_parts == 0:
            break
        if acc >= total * (len(bounds) + 1) / parts and n - (i + 1) >= remaining_parts:
            bounds.append((start, i + 1))
            start = i + 1
        elif n - (i + 1) == remaining_parts:  # exactly one layer left per remaining slice
            bounds.append((start, i + 1))
            start = i + 1
    bounds.append((start, n))
    return bounds


class _ParamTokens:
    """Saved-tensor hooks that replace device copies of parameters with tokens and re-copy on unpack."""

    def __init__(self, params: Mapping[str, torch.Tensor], copies: Mapping[str, torch.Tensor],
                 device: torch.device) -> None:
        self.params = params
        self.device = device
        self.by_ptr = {c.untyped_storage().data_ptr(): name for name, c in copies.items()}
        self.packed = 0

    def pack(self, t: torch.Tensor) -> Any:
        name = self.by_ptr.get(t.untyped_storage().data_ptr()) if t.device == self.device else None
        if name is None:
            return t
        self.packed += 1
        return (name, t.size(), t.stride(), t.storage_offset())

    def unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, torch.Tensor):
            return obj
        name, size, stride, offset = obj
        full = self.params[name].detach().to(self.device, copy=True)
        return full.as_strided(size, stride, offset)


class OffloadModel(nn.Module):
    """Keep ``model``'s parameters on ``offload_device``; compute slice by slice on ``device``.

    Args:
        model: an ``nn.Sequential`` (or a list of modules, run in order).
        device: the compute device.
        offload_device: where parameters, gradients and the optimizer live (default CPU).
        num_slices: how many contiguous slices to cut the layers into (at most one per layer).
        checkpoint_activation: recompute each slice in backward, keeping only slice inputs (on
            the offload device).
        num_microbatches: split the batch along dim 0 into this many microbatches.
    """

    def __init__(self, model: Any, device: Any, offload_device: Any = torch.device("cpu"), num_slices: int = 3,
                 checkpoint_activation: bool = False, num_microbatches: int = 1) -> None:
        super().__init__()
        if isinstance(model, (list, tuple)):
            model = nn.Sequential(*model)
        if not isinstance(model, nn.Sequential):
            raise TypeError(f"OffloadModel needs an nn.Sequential (or a list of modules), got {type(model).__name__}; "
                            "express the model as a sequence of layers")
        if num_slices < 1 or num_microbatches < 1:
            raise ValueError(f"num_slices ({num_slices}) and num_microbatches ({num_microbatches}) must be >= 1")
        self.device = torch.device(device)
        self.offload_device = torch.device(offload_device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"OffloadModel: device={self.device} but CUDA is not available; on a CPU-only machine "
                             "pass device='cpu' (parameters then stay where they are and nothing is copied)")
        self.checkpoint_activation = bool(checkpoint_activation)
        self.num_microbatches = int(num_microbatches)
        layers = list(model)
        sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        self.slices = [(a, b) for a, b in _split_balanced(sizes, num_slices)]
        model.to(self.offload_device)
        for layer in layers:  # buffers are small and updated in forward: they live on the compute device
            for mod in layer.modules():
                for name, b in list(mod._buffers.items()):
                    if b is not None:
                        mod._buffers[name] = b.to(self.device)
        self.model = model
        self._force_copies = False
        """Tests: copy parameters even when device == offload_device, to exercise the transfer path."""
        self._packed = 0
        """How many saved tensors were replaced by parameter tokens (tests read it)."""

    def _moves(self) -> bool:
        return self._force_copies or self.device != self.offload_device

    def _run_slice(self, index: int, x: torch.Tensor, tokens: bool = True) -> torch.Tensor:
        a, b = self.slices[index]
        part = self.model[a:b]
        params = dict(part.named_parameters())
        if not self._moves():
            return part(x)
        copies = {n: p.to(self.device, copy=True) for n, p in params.items()}
        if not tokens:  # inside a checkpoint, which already drops every saved tensor (copies included)
            return functional_call(part, copies, (x,))
        hooks = _ParamTokens(params, copies, self.device)
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            out = functional_call(part, copies, (x,))
        self._packed += hooks.packed
        return out

    def _run_slice_checkpointed(self, index: int, x: torch.Tensor) -> torch.Tensor:
        device = x.device

        def run(kept: torch.Tensor) -> torch.Tensor:
            return self._run_slice(index, kept.to(device), tokens=False)

        return torch.utils.checkpoint.checkpoint(run, x.to(self.offload_device), use_reentrant=False)

    def forward(self, *inputs: Any) -> torch.Tensor:
        if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor):
            raise TypeError("OffloadModel.forward takes one tensor (the input of the first layer)")
        x = inputs[0].to(self.device)
        chunks = list(x.chunk(self.num_microbatches, dim=0)) if self.num_microbatches > 1 else [x]
        checkpointed = self.checkpoint_activation and torch.is_grad_enabled()
        for i in range(len(self.slices)):
            run = self._run_slice_checkpointed if checkpointed else self._run_slice
            chunks = [run(i, c) for c in chunks]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=0)
