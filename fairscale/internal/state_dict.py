"""State-dict key helpers."""

from __future__ import annotations

from typing import MutableMapping

from torch import nn

__all__ = ["find_module_instances", "replace_by_prefix_"]


def find_module_instances(module: nn.Module, search_class: type[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Every submodule (``module`` included) that is a ``search_class``, with its state-dict key prefix.

    ``find_module_instances(nn.Sequential(nn.Linear(1, 1), nn.LayerNorm(1)), nn.LayerNorm)``
    gives ``[("1.", LayerNorm(...))]``; the root's prefix is ``""``.
    """
    found: list[tuple[str, nn.Module]] = []

    def visit(m: nn.Module, prefix: str) -> None:
        if isinstance(m, search_class):
            found.append((prefix, m))
        for name, child in m.named_children():
            visit(child, f"{prefix}{name}.")

    visit(module, "")
    return found


def replace_by_prefix_(state_dict: MutableMapping[str, object], old_prefix: str, new_prefix: str) -> None:
    """Rename, in place, every key starting with ``old_prefix`` to start with ``new_prefix``."""
    if old_prefix == new_prefix:
        raise ValueError("old_prefix and new_prefix must be distinct")
    for key in [k for k in state_dict if k.startswith(old_prefix)]:
        state_dict[new_prefix + key[len(old_prefix):]] = state_dict.pop(key)
