"""FairScale 0.4.13's ``fairscale.nn.pipe``: single-process GPipe, balance helpers, skip connections,
and :class:`MultiProcessPipe` (one rank per stage, on the compiler's pipeline runtime).

``is_checkpointing()`` / ``is_recomputing()`` tell a layer whether it runs inside a checkpointed
cell's first forward or its backward-time recomputation (e.g. to skip side effects once).
"""

from typing import Any

from fairscale.nn.pipe.batchnorm import is_checkpointing, is_recomputing
from fairscale.nn.pipe.pipe import BalanceError, Pipe

__all__ = ["Pipe", "MultiProcessPipe", "BalanceError", "is_checkpointing", "is_recomputing"]


def __getattr__(name: str) -> Any:
    # lazy: MultiProcessPipe pulls in capture and the pipeline runtime
    if name == "MultiProcessPipe":
        from fairscale.nn.pipe.multiprocess import MultiProcessPipe

        return MultiProcessPipe
    raise AttributeError(f"module 'fairscale.nn.pipe' has no attribute {name!r}")
