"""Attributes at dotted paths of a module tree (``"layers.0.attn.q_proj.weight"``): the one reader
and the one installer that capture, the passes and the runtime share. Dependency-free."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["fetch_attr", "install_attr"]


def fetch_attr(root: nn.Module, target: str) -> Any:
    """The object at dotted path ``target`` under ``root`` (AttributeError naming the missing part)."""
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def install_attr(root: nn.Module, target: str, value: Any, *, buffer: bool = True) -> None:
    """Put ``value`` (itself, never a copy) at dotted path ``target`` under ``root``, creating empty
    ``nn.Module`` parents on the way. A Parameter is registered as a parameter, a module as a
    submodule, another tensor as a buffer (``buffer=False``: a plain attribute, as torch.fx keeps
    constants), anything else as a plain attribute."""
    *path, leaf = target.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    elif isinstance(value, nn.Module):
        mod.add_module(leaf, value)
    elif isinstance(value, torch.Tensor) and buffer:
        mod.register_buffer(leaf, value)
    else:
        setattr(mod, leaf, value)
