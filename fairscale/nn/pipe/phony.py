"""Phony tensors: empty-valued tensors that only carry an autograd edge, to order backward passes.

Cached per (device, requires_grad), so building a pipeline's dependency graph allocates nothing.
"""

from __future__ import annotations

import torch

from fairscale.nn.pipe.stream import default_stream, use_stream

__all__ = ["get_phony"]

_phonies: dict[tuple[torch.device, bool], torch.Tensor] = {}


def get_phony(device: torch.device, *, requires_grad: bool) -> torch.Tensor:
    """The cached one-element phony of ``device`` (its value is meaningless).

    A phony that requires grad is a leaf; to put it in a graph, return ``phony.detach()`` from an
    autograd Function, which gives the result that Function's ``grad_fn``.
    """
    key = (device, requires_grad)
    phony = _phonies.get(key)
    if phony is None:
        with use_stream(default_stream(device)):
            phony = torch.empty(1, device=device, requires_grad=requires_grad)
        _phonies[key] = phony
    return phony
