"""FairScale 0.4.13's ``fairscale.nn.pipe``: single-process GPipe (:class:`Pipe`), balance helpers,
skip connections, and pipelines across processes: :class:`AsyncPipe` (one stage per rank, as in
0.4.13) and :class:`PipeRPCWrapper` (rank 0 drives an AsyncPipe through RPC).

``is_checkpointing()`` / ``is_recomputing()`` tell a layer whether it runs inside a checkpointed
micro-batch's first forward or its backward-time recomputation (e.g. to skip side effects once).
:class:`MultiProcessPipe` (ours, not in 0.4.13) runs a Sequential across ranks on the compiler's
pipeline runtime with GPipe/1F1B/interleaved schedules.
"""

from typing import Any

from fairscale.nn.pipe.checkpoint import is_checkpointing, is_recomputing
from fairscale.nn.pipe.pipe import BalanceError, Pipe

__all__ = ["Pipe", "AsyncPipe", "PipeRPCWrapper", "LazyModule", "MultiProcessPipe", "BalanceError",
           "is_checkpointing", "is_recomputing"]

_LAZY = {  # imported on first use: torch.distributed.rpc, capture and the pipeline runtime
    "AsyncPipe": "fairscale.nn.pipe.async_pipe",
    "PipeRPCWrapper": "fairscale.nn.pipe.rpc",
    "LazyModule": "fairscale.nn.pipe.types",
    "MultiProcessPipe": "fairscale.nn.pipe.multiprocess",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fairscale.nn.pipe' has no attribute {name!r}")
