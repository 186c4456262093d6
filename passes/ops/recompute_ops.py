"""The run-time op the recompute pass inserts: a region run under non-reentrant checkpointing.

``passes.insert_recompute`` fuses a layer's activation nodes into a submodule and calls it through
:func:`recompute_call`; the rank graph calls it at run time, so it lives with the other run-time ops.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["recompute_call", "RETAIN_LISTENERS"]

_SAVE_IN_SELECTIVE = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_IN_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


RETAIN_LISTENERS: list[Callable[[tuple[Any, ...]], None]] = []
"""Callbacks told the arguments each recompute region keeps alive until backward (for memory meters:
non-reentrant checkpointing holds them by reference, so saved_tensors_hooks never see them)."""


def recompute_call(fn: Callable[..., Any], kind: str, *args: Any) -> Any:
    """Run ``fn(*args)`` under non-reentrant checkpointing of the given kind."""
    for listener in RETAIN_LISTENERS:
        listener(args)
    if kind == "full":
        return checkpoint(fn, *args, use_reentrant=False)
    if kind == "selective":
        return checkpoint(fn, *args, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(_selective_policy))
    raise ValueError(f"recompute kind must be 'full' or 'selective', got {kind!r}")
