"""Heap inspection for memory tests."""

from __future__ import annotations

import gc

import torch

__all__ = ["find_tensor_by_shape"]


def find_tensor_by_shape(target_shape: tuple[int, ...], only_param: bool = True) -> bool:
    """True if a live tensor (a ``Parameter`` if ``only_param``) of ``target_shape`` is on the heap."""
    for obj in gc.get_objects():
        try:
            if only_param and not isinstance(obj, torch.nn.Parameter):
                continue
            tensor = obj if torch.is_tensor(obj) else getattr(obj, "data", None)
            if torch.is_tensor(tensor) and tuple(tensor.shape) == tuple(target_shape):
                return True
        except Exception:  # objects whose attributes raise (weakref proxies, half-built modules)
            continue
    return False
