"""Writes to a model's own tensors (and reads of its parameters) that a torch.fx trace runs once,
eagerly, and does not record.

torch.fx traces with Proxies standing for the inputs and the parameters it fetches by attribute;
tensors reached another way are real, and ops on them run while tracing instead of entering the
graph. A DINO/BYOL-style forward updating its momentum teacher through ``.data``::

    for ps, pt in zip(self.student.parameters(), self.teacher.parameters()):
        pt.data.mul_(m).add_((1 - m) * ps.detach().data)

defeats ``torch.export`` (a fake tensor in its constants) and then traced with fx: the update ran
once on the user's weights during the trace and never in training, where every step makes it. The
plan check then refused every plan with a message about pipeline stages. :func:`watch_eager_writes`
stops such a trace at the first write, before it runs (the model is left as it was), and names the
tensor and the source line, so the capture can refuse the model with what to do. The same holds
for a parameter read that way with gradients on (an L2 penalty over ``self.parameters()`` in
forward): fx kept the penalty as a constant, and its gradient was lost.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from planner.host_random import call_site

__all__ = ["EagerWrite", "watch_eager_writes", "written_tensors"]


class EagerWrite(Exception):
    """A traced forward wrote one of the model's tensors outside the graph (or, ``read``, computed
    from a parameter that needs a gradient there: the result would be a constant without one)."""

    def __init__(self, tensor: str, site: str, *, read: bool = False) -> None:
        super().__init__(f"{tensor}: {site}")
        self.tensor, self.site, self.read = tensor, site, read


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass, sparse)
        return None


_SHAPE_ONLY = frozenset(f"aten::{op}" for op in (
    "new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided", "zeros_like", "ones_like",
    "empty_like", "full_like"))
"""Ops that read a tensor's shape, dtype and device, not its values, and make no gradient: an RNN's
first hidden state from ``next(self.parameters()).new_zeros(...)`` (PyTorch's word_language_model)
is the same constant in fx's graph as in every step, not a parameter read fx loses the gradient of."""


class _Watch(TorchDispatchMode):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.owners: dict[int, str] = {}
        for kind, named in (("parameter", model.named_parameters), ("buffer", model.named_buffers)):
            for name, t in named(remove_duplicate=False):
                key = _storage(t)
                if key is not None:
                    self.owners.setdefault(key, f"{kind} {name}")

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = getattr(func, "_schema", None)
        if self.owners and torch.is_grad_enabled() and getattr(schema, "name", "") not in _SHAPE_ONLY:
            # L2 of self.parameters() in forward: a constant to fx
            for t in tree_flatten((args, kwargs))[0]:
                owner = self.owners.get(_storage(t) or 0) if isinstance(t, torch.Tensor) and t.requires_grad else None
                if owner is not None:
                    raise EagerWrite(owner, call_site(f"aten.{func.__name__}", self.model), read=True)
        if self.owners:
            for t in written_tensors(func, args, kwargs):
                owner = self.owners.get(_storage(t) or 0)
                if owner is not None:
                    raise EagerWrite(owner, call_site(f"aten.{func.__name__}", self.model))
        return func(*args, **kwargs)


def written_tensors(func: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an ATen op called with ``args`` and ``kwargs`` writes in place, by its schema:
    ``self`` of ``mul_``, an ``out=`` argument, each tensor of a list (``_foreach_lerp_``)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    values = dict(zip((a.name for a in schema.arguments), args)) | kwargs
    return [t for arg in schema.arguments if arg.alias_info is not None and arg.alias_info.is_write
            for t in tree_flatten(values.get(arg.name))[0] if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def watch_eager_writes(model: nn.Module) -> Iterator[None]:
    """Within the block (a torch.fx trace of ``model``), raise :class:`EagerWrite` before any op
    runs that writes in place to a tensor sharing storage with one of ``model``'s parameters or
    buffers (``p.data.mul_``, ``p.detach().copy_``), or assigns one's ``.data``: such an op is not a
    Proxy's, so it would run now and never in the graph."""
    watch = _Watch(model)
    base = torch._C.TensorBase.__dict__["data"]

    def assign(t: torch.Tensor, value: torch.Tensor) -> None:  # MoCo's pk.data = pk.data * m + pq.data * (1 - m)
        owner = watch.owners.get(_storage(t) or 0)
        if owner is not None:
            raise EagerWrite(owner, call_site("Tensor.data =", model))
        base.__set__(t, value)

    torch.Tensor.data = property(base.__get__, assign)  # type: ignore[assignment]
    try:
        with watch:
            yield
    finally:
        del torch.Tensor.data
