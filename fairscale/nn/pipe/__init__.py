"""FairScale 0.4.13's ``fairscale.nn.pipe``: single-process GPipe (:class:`Pipe`), balance helpers,
skip connections, and pipelines across processes.

``is_checkpointing()`` / ``is_recomputing()`` tell a layer whether it runs inside a checkpointed
micro-batch's first forward or its backward-time recomputation (e.g. to skip side effects once).
:class:`MultiProcessPipe` (ours, not in 0.4.13) runs a Sequential across ranks on the compiler's
pipeline runtime with GPipe/1F1B/interleaved schedules.
"""

from typing import Any

from fairscale.nn.pipe.checkpoint import is_checkpointing, is_recomputing
from fairscale.nn.pipe.pipe import BalanceError, Pipe

__all__ = ["Pipe", "MultiProcessPipe", "BalanceError", "is_checkpointing", "is_recomputing"]


def __getattr__(name: str) -> Any:
    # lazy: MultiProcessPipe pulls in capture and the pipeline runtime
    if name == "MultiProcessPipe":
        from fairscale.nn.pipe.multiprocess import MultiProcessPipe

        return MultiProcessPipe
    raise AttributeError(f"module 'fairscale.nn.pipe' has no attribute {name!r}")
