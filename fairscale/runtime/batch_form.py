"""The form of a batch handed to a ParallelModule after ``parallelize``: positional, as captured.

``parallelize`` refuses a dict ``example_inputs`` (``fairscale.arguments``), but the calls after it
took whatever came: a Hugging Face collator's dict passed to ``pm.train_step(batch)`` ran the rank
graphs on its keys (``Unable to cast x to Tensor`` from deep inside aten), ``pm(**batch)`` failed
in Python with no word of what to do, and a bare tensor was iterated row by row as if each row were
an input. :func:`check_batch_form` refuses them on every rank, before anything runs, saying how to
pass the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import torch

__all__ = ["check_batch_form"]


def check_batch_form(batch: Any, call: str, named: Mapping[str, Any] | None = None) -> None:
    """Raise ``TypeError`` unless ``batch`` is a tuple or list of positional inputs and no input
    was given by keyword (``named``)."""
    keys: Sequence[str] = list(named or {}) or (list(map(str, batch)) if isinstance(batch, Mapping) else [])
    if keys or isinstance(batch, Mapping):
        example = f"({', '.join(f'batch[{k!r}]' for k in keys[:3])}{', ...' if len(keys) > 3 else ''})"
        raise TypeError(f"{call} takes the global batch as the model's positional inputs, in the order example_inputs "
                        f"gave them, not by name ({', '.join(keys) or 'an empty dict'}): pass a tuple in the order of "
                        f"the forward's parameters, e.g. {example}")
    if isinstance(batch, torch.Tensor):
        raise TypeError(f"{call} takes the global batch as a tuple of the model's positional inputs, got a Tensor of "
                        f"shape {tuple(batch.shape)}: wrap a single input as (x,), or pass (inputs, labels)")
    if not isinstance(batch, (tuple, list)):
        raise TypeError(f"{call} takes the global batch as a tuple of the model's positional inputs, got "
                        f"{type(batch).__name__}")
