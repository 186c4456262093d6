"""FairScale 0.4.13's ``fairscale.nn`` namespace, on our runtime.

    from fairscale.nn import FullyShardedDataParallel, auto_wrap, enable_wrap, wrap, checkpoint_wrapper

Names resolve lazily (PEP 562 module ``__getattr__``): importing ``fairscale.nn`` costs nothing,
and a component whose module is missing or broken fails only when that name is used, with the
import error that explains why.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "FullyShardedDataParallel": "fairscale.nn.data_parallel.fully_sharded_data_parallel",
    "ShardedDataParallel": "fairscale.nn.data_parallel.sharded_ddp",
    "checkpoint_wrapper": "fairscale.nn.checkpoint.checkpoint_activations",
    "auto_wrap": "fairscale.nn.wrap.auto_wrap",
    "enable_wrap": "fairscale.nn.wrap.auto_wrap",
    "wrap": "fairscale.nn.wrap.auto_wrap",
    "default_auto_wrap_policy": "fairscale.nn.wrap.auto_wrap",
    "config_auto_wrap_policy": "fairscale.nn.wrap.auto_wrap",
    "FlattenParamsWrapper": "fairscale.nn.misc.flatten_params_wrapper",
    "Pipe": "fairscale.nn.pipe",
    "PipeRPCWrapper": "fairscale.nn.pipe",
    "MultiProcessPipe": "fairscale.nn.pipe",
    "MOELayer": "fairscale.nn.moe",
    "Top2Gate": "fairscale.nn.moe",
}

__all__ = sorted(_EXPORTS)

# Bound eagerly, as FairScale did: the name ``wrap`` is both a subpackage and a function, and the
# function must win (importing the subpackage later would otherwise rebind the attribute to it).
from fairscale.nn.wrap.auto_wrap import (  # noqa: E402
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    wrap,
)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fairscale.nn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
