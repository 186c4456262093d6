"""``fairscale.nn.data_parallel``: FullyShardedDataParallel (ZeRO-3) and ShardedDataParallel (ZeRO-2),
with ``auto_wrap_bn`` and ``get_fsdp_instances``.

Names resolve lazily, so each component imports only when used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "FullyShardedDataParallel": "fairscale.nn.data_parallel.fully_sharded_data_parallel",
    "TrainingState": "fairscale.nn.data_parallel.fully_sharded_data_parallel",
    "ShardedDataParallel": "fairscale.nn.data_parallel.sharded_ddp",
    "auto_wrap_bn": "fairscale.nn.data_parallel.fsdp_helpers",
    "get_fsdp_instances": "fairscale.nn.data_parallel.fsdp_helpers",
}

__all__ = ["FullyShardedDataParallel", "ShardedDataParallel", "TrainingState", "auto_wrap_bn", "get_fsdp_instances"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fairscale.nn.data_parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
