"""The form of a batch: the model's positional inputs, as captured, or a dict of them by name.

A batch is the forward's positional inputs in order, ``(input_ids, labels)``. A Hugging Face
collator hands a dict (``{"input_ids": ..., "attention_mask": ..., "labels": ...}``) that the user
passes as ``model(**batch)``; ``example_inputs`` may be such a dict too, for a model that computes
its own loss. :func:`keyword_example` reads the forward's signature once and turns the dict into
the positional tuple (a :class:`KeywordBatch`: a parameter before the last given one that the dict
leaves out gets its default, ``None`` for Hugging Face's optional inputs), and every later batch is
turned into that form by the same names (:func:`positional_batch`): the same keys, or the
positional tuple itself.

A batch in any other form is refused on every rank before anything runs, saying how to pass it:
a dict handed to a module whose example was a tuple had run the rank graphs on its keys
(``Unable to cast x to Tensor`` from deep inside aten), and a bare tensor was iterated row by row
as if each row were an input.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

__all__ = ["BatchKeys", "KeywordBatch", "keyword_example", "positional_batch", "check_batch_form",
           "microbatch_example", "batch_chunks"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclass(frozen=True)
class BatchKeys:
    """How a batch given by name maps to the forward's positional inputs."""

    owner: str
    """``Model.forward``, for messages."""
    params: tuple[str, ...]
    """The forward's positional parameters, up to the last one the example names."""
    given: tuple[str, ...]
    """The names the example gave, in its order."""
    defaults: tuple[Any, ...]
    """Each parameter's default, passed where the batch does not name it."""

    @classmethod
    def of(cls, forward: Callable[..., Any], owner: str, names: Sequence[str]) -> BatchKeys:
        """The mapping for a batch with keys ``names``; TypeError naming the key a forward cannot take
        positionally (a keyword-only parameter, one only ``**kwargs`` takes) or the input it lacks."""
        sig = inspect.signature(forward)
        positional = [p for p in sig.parameters.values() if p.kind in _POSITIONAL]
        order = [p.name for p in positional]
        for key in names:
            if key not in order:
                how = ("is keyword-only" if key in sig.parameters else
                       "is taken only by its **kwargs" if any(p.kind is inspect.Parameter.VAR_KEYWORD
                                                              for p in sig.parameters.values())
                       else "is not one of its parameters")
                raise TypeError(f"example_inputs names {key!r}, which {owner} {how}: a batch given by name is passed "
                                f"to the forward positionally, so each key must be one of its positional parameters "
                                f"({', '.join(order) or 'none'}). Leave {key!r} out, or wrap the model in a module "
                                f"whose forward takes {key!r} as a parameter and passes it on by name")
        last = max(order.index(k) for k in names)
        missing = [p.name for p in positional[:last + 1] if p.name not in names and p.default is p.empty]
        if missing:
            raise TypeError(f"example_inputs gives {', '.join(map(repr, names))} by name but not {missing[0]!r}, "
                            f"which {owner} requires: add it to the batch")
        return cls(owner=owner, params=tuple(order[:last + 1]), given=tuple(names),
                   defaults=tuple(p.default for p in positional[:last + 1]))

    def positional(self, batch: Mapping[str, Any], call: str) -> tuple[Any, ...]:
        """``batch``'s values in the forward's order; TypeError unless it has the example's keys."""
        keys = list(map(str, batch))
        if set(keys) != set(self.given):
            missing, extra = [k for k in self.given if k not in keys], [k for k in keys if k not in self.given]
            raise TypeError(f"{call} got a batch with keys ({', '.join(keys)}), but example_inputs gave "
                            f"({', '.join(self.given)}): every batch passes the same inputs"
                            + (f"; missing: {', '.join(missing)}" if missing else "")
                            + (f"; not in the example: {', '.join(extra)}" if extra else ""))
        return tuple(batch[p] if p in batch else d for p, d in zip(self.params, self.defaults))


class KeywordBatch(tuple):
    """The positional form of a batch given by name; ``batch_keys`` maps later batches alike."""

    batch_keys: BatchKeys

    def __new__(cls, values: Sequence[Any], keys: BatchKeys) -> KeywordBatch:
        out = super().__new__(cls, values)
        out.batch_keys = keys
        return out


def keyword_example(model: torch.nn.Module, example: Mapping[str, Any], loss_fn: Any) -> KeywordBatch:
    """``example`` (a dict of the forward's inputs by name) as the positional batch."""
    owner = f"{type(model).__name__}.forward"
    if loss_fn is not None:
        raise TypeError(f"example_inputs is a dict ({', '.join(map(str, example))}) and loss_fn is given: with "
                        "loss_fn the batch is (model input, *loss_fn's other arguments), a tuple. Pass a tuple, or "
                        "leave loss_fn out for a model that returns its loss (Hugging Face's, given labels)")
    if not example:
        raise TypeError("example_inputs is an empty dict; pass the model's inputs, by name or as a tuple")
    keys = BatchKeys.of(model.forward, owner, [str(k) for k in example])
    return KeywordBatch(keys.positional(example, "example_inputs"), keys)


def positional_batch(batch: Any, call: str, named: Mapping[str, Any] | None = None,
                     keys: BatchKeys | None = None) -> tuple[Any, ...]:
    """``batch`` (or the inputs passed by name, ``named``) as the positional tuple the module runs:
    by ``keys`` where the example was given by name; TypeError for any form it cannot be."""
    if keys is not None and not named and isinstance(batch, tuple) and len(batch) == 1 \
            and isinstance(batch[0], Mapping):
        batch = batch[0]  # pm(batch) with the dict
    if keys is not None and (named or isinstance(batch, Mapping)):
        if named and batch:
            raise TypeError(f"{call} takes the batch by name or by position, not both")
        return keys.positional(named or batch, call)
    check_batch_form(batch, call, named, by_name=keys is not None)
    if keys is not None and len(batch) != len(keys.params):
        raise TypeError(f"{call} got {len(batch)} positional inputs, but example_inputs gave "
                        f"({', '.join(keys.given)}) by name, {len(keys.params)} inputs in {keys.owner}'s order "
                        f"({', '.join(keys.params)}): pass the batch as a dict with the same keys")
    return tuple(batch)


def check_batch_form(batch: Any, call: str, named: Mapping[str, Any] | None = None, *, by_name: bool = False) -> None:
    """Raise ``TypeError`` unless ``batch`` is a tuple or list of positional inputs and no input
    was given by keyword (``named``)."""
    keys: Sequence[str] = list(named or {}) or (list(map(str, batch)) if isinstance(batch, Mapping) else [])
    if keys or isinstance(batch, Mapping):
        example = f"({', '.join(f'batch[{k!r}]' for k in keys[:3])}{', ...' if len(keys) > 3 else ''})"
        raise TypeError(f"{call} takes the global batch as the model's positional inputs, in the order example_inputs "
                        f"gave them, not by name ({', '.join(keys) or 'an empty dict'}), since example_inputs was a "
                        f"tuple: pass a tuple in the order of the forward's parameters, e.g. {example}, or give "
                        "example_inputs to fairscale.parallelize as a dict too")
    what = (f"a Tensor of shape {tuple(batch.shape)}: wrap a single input as (x,), or pass (inputs, labels)"
            if isinstance(batch, torch.Tensor) else type(batch).__name__)
    if not isinstance(batch, (tuple, list)):
        form = "a dict of the inputs example_inputs named, or " if by_name else ""
        raise TypeError(f"{call} takes the global batch as {form}a tuple of the model's positional inputs, got {what}")


def microbatch_example(batch: Sequence[Any], size: int) -> tuple[Any, ...]:
    """``batch`` cut or tiled along dim 0 to ``size`` rows: the shape one rank's microbatch has."""
    out = []
    for t in batch:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            reps = -(-size // t.shape[0])
            out.append(t.repeat(reps, *([1] * (t.dim() - 1)))[:size] if reps > 1 else t[:size])
        else:
            out.append(t)
    return tuple(out)


def batch_chunks(batch: Sequence[Any], m: int) -> list[list[Any]]:
    """``batch`` cut into ``m`` microbatches along dim 0, as the pipeline cuts it (non-tensors in each)."""
    parts: list[list[Any]] = [[] for _ in range(m)]
    for x in batch:
        pieces = x.chunk(m) if isinstance(x, torch.Tensor) and x.dim() > 0 else [x] * m
        for p, piece in zip(parts, pieces):
            p.append(piece)
    return parts
