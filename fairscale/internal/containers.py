"""Tensors inside Python containers: map over them, split them from other values, pack kwargs."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

__all__ = ["apply_to_type", "apply_to_tensors", "to_np", "from_np", "pack_kwargs", "unpack_kwargs",
           "split_non_tensors", "unpack_non_tensors"]


def apply_to_type(type_fn: Callable[[Any], bool], fn: Callable[[Any], Any], container: Any) -> Any:
    """``container`` rebuilt with ``fn(x)`` in place of every ``x`` for which ``type_fn(x)`` holds.

    Walks dicts (OrderedDicts keep their class), lists, tuples (namedtuples keep their type), sets
    and PackedSequences (``fn`` runs on ``.data``, and the sequence itself is returned: an in-place
    ``fn`` changes it, anything else is ignored, as a PackedSequence cannot be rebuilt from data).
    """

    def walk(x: Any) -> Any:
        if type_fn(x):
            return fn(x)
        if isinstance(x, PackedSequence):
            walk(x.data)
            return x
        if isinstance(x, OrderedDict):
            out = x.__class__()
            for k, v in x.items():
                out[k] = walk(v)
            return out
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            if hasattr(x, "_fields"):  # namedtuple
                return type(x)(**{k: walk(v) for k, v in x._asdict().items()})
            return tuple(walk(v) for v in x)
        if isinstance(x, set):
            return {walk(v) for v in x}
        return x

    return walk(container)


def apply_to_tensors(fn: Callable[[torch.Tensor], Any], container: Any) -> Any:
    """:func:`apply_to_type` on every tensor."""
    return apply_to_type(torch.is_tensor, fn, container)


def to_np(tensor_or_container: Any) -> Any:
    """Every tensor as a numpy array (on the CPU)."""
    return apply_to_type(torch.is_tensor, lambda t: t.cpu().numpy(), tensor_or_container)


def from_np(ndarray_or_container: Any) -> Any:
    """Every numpy array as a tensor sharing its memory."""
    return apply_to_type(lambda x: isinstance(x, np.ndarray), torch.from_numpy, ndarray_or_container)


def pack_kwargs(*args: Any, **kwargs: Any) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """``(kwarg names, positional values + kwarg values)``, so a call can cross an autograd
    Function that takes positional arguments only; :func:`unpack_kwargs` reverses it::

        keys, flat = pack_kwargs(1, 2, a=3)     # ("a",), (1, 2, 3)
        args, kwargs = unpack_kwargs(keys, flat)  # (1, 2), {"a": 3}
    """
    return tuple(kwargs), tuple(args) + tuple(kwargs.values())


def unpack_kwargs(kwarg_keys: Any, flat_args: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """See :func:`pack_kwargs`; the last ``len(kwarg_keys)`` values are the keyword arguments."""
    n = len(kwarg_keys)
    assert n <= len(flat_args), f"too many keys: {n} keyword names for {len(flat_args)} values"
    if n == 0:
        return flat_args, {}
    return flat_args[:-n], dict(zip(kwarg_keys, flat_args[-n:]))


def split_non_tensors(mixed: Any) -> tuple[tuple[torch.Tensor, ...], dict[str, list[Any]] | None]:
    """The tensors of the tuple ``mixed``, and what :func:`unpack_non_tensors` needs to put the other
    values back in their places (``None`` for a lone tensor)::

        split_non_tensors((x, None, 3))  # (x,), {"is_tensor": [True, False, False], "objects": [None, 3]}
    """
    if isinstance(mixed, torch.Tensor):
        return (mixed,), None
    is_tensor = [isinstance(o, torch.Tensor) for o in mixed]
    tensors = tuple(o for o, t in zip(mixed, is_tensor) if t)
    objects = [o for o, t in zip(mixed, is_tensor) if not t]
    return tensors, {"is_tensor": is_tensor, "objects": objects}


def unpack_non_tensors(tensors: tuple[torch.Tensor, ...], packed_non_tensors: dict[str, list[Any]] | None
                       ) -> tuple[Any, ...]:
    """See :func:`split_non_tensors`."""
    if packed_non_tensors is None:
        return tensors
    assert isinstance(packed_non_tensors, dict), f"expected the dict split_non_tensors made, got {type(packed_non_tensors)}"
    is_tensor, objects = packed_non_tensors["is_tensor"], packed_non_tensors["objects"]
    assert len(tensors) + len(objects) == len(is_tensor), (
        f"{len(tensors)} tensors + {len(objects)} objects do not fill {len(is_tensor)} places")
    tensor_it, object_it = iter(tensors), iter(objects)
    return tuple(next(tensor_it) if t else next(object_it) for t in is_tensor)
