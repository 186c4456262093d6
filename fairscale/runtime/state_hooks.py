"""The model's own state-dict hooks, applied to the gathered state dict.

``ParallelModule.state_dict()`` gathers every tensor under its parameter or buffer name
(``model.named_parameters()``/``named_buffers()``). A model may save under other names: a fused QKV
projection that registers a state-dict hook splitting ``qkv.weight`` into ``q``/``k``/``v`` (as
checkpoint-compatible LLM codebases do), or ``_register_state_dict_hook`` renames. Those keys are
what ``model.load_state_dict`` and the user's other tools expect, so the gathered tensors are put
in the model's place for one call of ``model.state_dict()``, which runs the hooks, and taken out
again (the model's own tensors are untouched; nothing is copied).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fairscale.runtime.model_guard import refuse_stale_state_dict

__all__ = ["has_state_dict_hooks", "apply_state_dict_hooks"]


def has_state_dict_hooks(model: nn.Module) -> bool:
    """Whether any module of ``model`` changes what ``state_dict()`` returns (post or pre hooks)."""
    return any(getattr(m, "_state_dict_hooks", None)
               or any(h is not refuse_stale_state_dict for h in getattr(m, "_state_dict_pre_hooks", {}).values())
               for m in model.modules())


def apply_state_dict_hooks(model: nn.Module, gathered: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as it would be with ``gathered`` (user parameter and buffer names ->
    tensors) as its tensors: the hooks' keys and values, and no non-persistent buffer (Hugging
    Face BERT's ``position_ids``), which ``state_dict()`` leaves out and ``load_state_dict``
    refuses. Without hooks, ``gathered`` less those buffers."""
    if not has_state_dict_hooks(model):
        skip = {f"{path}.{name}" if path else name for path, m in model.named_modules(remove_duplicate=False)
                for name in m._non_persistent_buffers_set}
        return {k: v for k, v in gathered.items() if k not in skip} if skip else gathered
    with _swapped(model, gathered):
        out = model.state_dict()
    missing = {k: v for k, v in gathered.items() if k not in out and not _is_own(model, k)}
    return {**out, **missing}  # extra gathered entries the model does not name (none expected)


def _is_own(model: nn.Module, key: str) -> bool:
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(dict(model.named_buffers(remove_duplicate=False)))
    return key in own


@contextmanager
def _swapped(model: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    saved: list[tuple[dict[str, object], str, object]] = []
    try:
        for key, t in tensors.items():
            owner_path, _, attr = key.rpartition(".")
            try:
                owner = model.get_submodule(owner_path) if owner_path else model
            except AttributeError:
                continue
            for table in (owner._parameters, owner._buffers):
                if attr in table and table[attr] is not None:
                    saved.append((table, attr, table[attr]))
                    old = table[attr]
                    table[attr] = nn.Parameter(t, requires_grad=False) if isinstance(old, nn.Parameter) else t
                    break
        yield
    finally:
        for table, attr, old in reversed(saved):
            table[attr] = old
