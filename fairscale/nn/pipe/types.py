"""Types of the pipe package: :class:`LazyModule` (a layer built only on the rank that holds it)."""

from __future__ import annotations

from typing import Callable

from torch import nn

from fairscale.nn.pipe.microbatch import Tensors, TensorOrTensors

__all__ = ["LazyModule", "Tensors", "TensorOrTensors"]


class LazyModule:
    """A layer given as a constructor: an :class:`~fairscale.nn.pipe.AsyncPipe` built from a list of
    them calls only the constructors of the layers its own rank holds (models too large to build
    whole on one rank)::

        layers = [LazyModule(lambda: nn.Linear(8192, 8192)) for _ in range(96)]
        pipe = AsyncPipe(layers, balance=[24] * 4, worker_map=worker_map)
    """

    def __init__(self, function: Callable[[], nn.Module]) -> None:
        self.function = function

    def __call__(self) -> nn.Module:
        return self.function()
