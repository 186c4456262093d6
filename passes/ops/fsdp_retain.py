"""A second backward through a retained graph (``loss.backward(retain_graph=True)``, then again)
under FSDP: the units the first backward freed are gathered again before the second reads them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from passes.ops.groups import current

if TYPE_CHECKING:
    from passes.ops.dp_ops import FSDPUnit

__all__ = ["regather_on_backward"]


def regather_on_backward(out: torch.Tensor, units: list[FSDPUnit]) -> None:
    """Make a backward through ``out``'s graph after an earlier one (``retain_graph=True``) find its
    units gathered. A unit nothing re-gathers in backward (not resharded after forward: the root, a
    stage's last unit) is freed by the first backward, whose saved views then read a freed buffer;
    a pre-hook on ``out``'s node gathers such units again first. If a unit's shard changed since the
    forward (an optimizer step between the two backwards), its buffer's version is bumped, so the
    backward fails as PyTorch's does for a parameter changed in place, instead of silently reading
    the new values."""
    kept = [(u, u.flat._version) for u in units if not u.reshard]
    if not kept or out.grad_fn is None:
        return
    table = current()

    def regather(grad_outputs: Any) -> None:
        with table.active():
            for u, version in kept:
                if not u.is_gathered:
                    u.gather()
                    if u.flat._version != version:
                        torch.autograd.graph.increment_version(u.full)

    out.grad_fn.register_prehook(regather)
