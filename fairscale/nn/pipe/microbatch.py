"""Micro-batches: a mini-batch (a tensor or a tuple of tensors) cut along dim 0, and put back.

    batches = scatter(x, chunks=4)       # [Batch(x[0:b]), Batch(x[b:2b]), ...], each knowing its index
    y = gather(batches)                  # torch.cat of the pieces (per tuple position)

A :class:`Batch` is "atomic" when it holds one tensor, and otherwise holds a tuple; layers of a Pipe
receive it in the same form (a tensor, or a tuple as their one argument).
"""

from __future__ import annotations

import typing
from typing import Any, Callable, Iterator, Union

import torch
from torch import Tensor

__all__ = ["Batch", "check", "scatter", "gather", "Tensors", "TensorOrTensors", "Function"]

Tensors = typing.Tuple[Tensor, ...]
TensorOrTensors = Union[Tensor, Tensors]
Function = Callable[[TensorOrTensors], TensorOrTensors]


class Batch:
    """One micro-batch: a tensor (atomic) or a tuple of tensors, and its index in the mini-batch."""

    def __init__(self, values: TensorOrTensors, index: int = 0) -> None:
        self._values = values
        self.atomic = torch.is_tensor(values)
        self._index = index

    @property
    def index(self) -> int:
        return self._index

    @property
    def tensor(self) -> Tensor:
        """The tensor of an atomic batch."""
        if not self.atomic:
            raise AttributeError("not an atomic batch: it holds a tuple; use .tensors")
        return typing.cast(Tensor, self._values)

    @property
    def tensors(self) -> Tensors:
        """The tuple of a non-atomic batch."""
        if self.atomic:
            raise AttributeError("an atomic batch holds one tensor; use .tensor")
        return typing.cast(Tensors, self._values)

    @property
    def tensor_or_tensors(self) -> TensorOrTensors:
        return self._values

    def call(self, function: Function) -> "Batch":
        """``function`` applied to the values, as a batch with the same index."""
        return Batch(function(self._values), self._index)

    def find_tensor_idx(self) -> int:
        """The position of the first tensor (0 for an atomic batch)."""
        if self.atomic:
            return 0
        for i, value in enumerate(self.tensors):
            if torch.is_tensor(value):
                return i
        raise TypeError("the batch holds no tensor")

    def __repr__(self) -> str:
        return f"Batch[atomic={self.atomic!r}]({self._values!r})"

    def __iter__(self) -> Iterator[Tensor]:
        return iter((self.tensor,) if self.atomic else self.tensors)

    def __len__(self) -> int:
        return 1 if self.atomic else len(self.tensors)

    def __getitem__(self, index: int) -> Tensor:
        if not self.atomic:
            return self.tensors[index]
        if index != 0:
            raise IndexError("an atomic batch has only index 0")
        return self.tensor

    @typing.overload
    def __setitem__(self, index: int, value: Tensor) -> None: ...

    @typing.overload
    def __setitem__(self, index: slice, value: Tensors) -> None: ...

    def __setitem__(self, index: Union[int, slice], value: Any) -> None:
        if isinstance(index, int):
            if self.atomic:
                if index != 0:
                    raise IndexError("an atomic batch has only index 0")
                self._values = value
            else:
                values = list(self.tensors)
                values[index] = value
                self._values = tuple(values)
            return
        if not isinstance(index, slice):
            raise TypeError(f"batch index must be an int or a slice, got {type(index).__name__}")
        if self.atomic:
            (self._values,) = value  # an atomic batch takes exactly one tensor
        else:
            values = list(self.tensors)
            values[index] = value
            self._values = tuple(values)


def check(input: Any) -> None:  # noqa: A002 - torchgpipe's name
    """Raise ``TypeError`` unless ``input`` is a tensor or a tuple of tensors."""
    if isinstance(input, tuple):
        for x in input:
            check(x)
        return
    if not torch.is_tensor(input):
        raise TypeError(f"expected Tensor, but got {input.__class__.__name__}")


def scatter(input: TensorOrTensors, chunks: int) -> list[Batch]:  # noqa: A002
    """Cut the mini-batch into at most ``chunks`` micro-batches along dim 0 (``torch.chunk``: fewer
    when the batch is smaller); a tuple is cut position by position."""
    if torch.is_tensor(input):
        pieces: list[Any] = list(typing.cast(Tensor, input).chunk(chunks))
    else:
        per_tensor = [x.chunk(chunks) for x in input]
        if len({len(p) for p in per_tensor}) > 1:
            raise ValueError("the tensors of a tuple input cut into different numbers of micro-batches; "
                             "give them the same size along dim 0")
        pieces = list(zip(*per_tensor))
    return [Batch(p, i) for i, p in enumerate(pieces)]


def gather(outputs: list[Batch]) -> TensorOrTensors:
    """Concatenate the micro-batch outputs back into one mini-batch (per tuple position)."""
    if outputs[0].atomic:
        return torch.cat([b.tensor for b in outputs])
    return tuple(torch.cat(parts) for parts in zip(*(b.tensors for b in outputs)))
