"""Python objects as byte tensors, to send them with tensor collectives."""

from __future__ import annotations

import pickle
from typing import Any

import torch

__all__ = ["pyobject_to_tensor", "tensor_to_pyobject"]


def pyobject_to_tensor(obj: Any, fixed_buffer_size: int = 0) -> torch.Tensor:
    """``obj`` pickled into a uint8 tensor, zero-padded to ``fixed_buffer_size`` bytes if given."""
    data = pickle.dumps(obj)
    if fixed_buffer_size and len(data) > fixed_buffer_size:
        raise ValueError(f"message too big to send: {len(data)} bytes > fixed_buffer_size={fixed_buffer_size}; "
                         "increase fixed_buffer_size")
    # lint: cpu -- pickled bytes are built on the host; callers move them to the collective's device
    out = torch.zeros(max(len(data), fixed_buffer_size), dtype=torch.uint8, device="cpu")
    out[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def tensor_to_pyobject(tensor: torch.Tensor) -> Any:
    """The object :func:`pyobject_to_tensor` packed (trailing padding is ignored by the unpickler)."""
    return pickle.loads(tensor.cpu().numpy().tobytes())
