"""Helpers around FullyShardedDataParallel that FairScale 0.4.13 exported next to it.

    from fairscale.nn.data_parallel import auto_wrap_bn, get_fsdp_instances

    model = auto_wrap_bn(model)            # every BatchNorm in its own fp32, unflattened FSDP
    model = FSDP(model, mixed_precision=True)
    for inst in get_fsdp_instances(model, skip_empty=True): ...
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fairscale.internal.parallel import get_process_group_cached
from fairscale.nn.data_parallel.fully_sharded_data_parallel import FullyShardedDataParallel
from fairscale.nn.wrap.auto_wrap import auto_wrap, config_auto_wrap_policy, enable_wrap

__all__ = ["auto_wrap_bn", "get_fsdp_instances"]


def auto_wrap_bn(module: nn.Module, single_rank_pg: bool = False, process_group: Any = None,
                 fsdp_config: dict[str, Any] | None = None, wrap_it: bool = True,
                 assert_on_collision: bool = True) -> nn.Module:
    """Wrap every batch-norm layer of ``module`` in its own FSDP instance that keeps its parameters
    in full precision and unflattened, so an outer mixed-precision, flattening FSDP leaves them alone.

    Args:
        single_rank_pg: give the batch norms a group of this rank only (no sharding).
        process_group: their group otherwise (default: the world).
        fsdp_config: the FSDP arguments for them (default: ``mixed_precision=False,
            flatten_parameters=False, reshard_after_forward=False, bucket_cap_mb=0,
            force_input_to_fp32=False``).
        wrap_it: wrap now (``False``: only tag the layers with ``wrapper_config``, for a later
            ``auto_wrap`` under ``config_auto_wrap_policy``).
        assert_on_collision: refuse a layer that already carries a ``wrapper_config``.
    """
    group = get_process_group_cached(ranks=[dist.get_rank()]) if single_rank_pg else process_group
    if fsdp_config is None:
        fsdp_config = {"process_group": group, "mixed_precision": False, "flatten_parameters": False,
                       "reshard_after_forward": False, "bucket_cap_mb": 0, "force_input_to_fp32": False}
    for m in module.modules():
        if isinstance(m, _BatchNorm):
            if assert_on_collision and hasattr(m, "wrapper_config"):
                raise AssertionError(f"{type(m).__name__} already has a wrapper_config; is it tagged by another "
                                     "policy? pass assert_on_collision=False to overwrite it")
            m.wrapper_config = fsdp_config  # type: ignore[assignment]
    if not wrap_it:
        return module
    with enable_wrap(config_auto_wrap_policy, wrapper_cls=FullyShardedDataParallel):
        return auto_wrap(module)


def get_fsdp_instances(mod: nn.Module, skip_empty: bool = False) -> list[FullyShardedDataParallel]:
    """Every FSDP instance in ``mod`` (itself included), in ``modules()`` order; ``skip_empty``
    leaves out those that own no parameter."""
    found = [m for m in mod.modules() if isinstance(m, FullyShardedDataParallel)]
    return [m for m in found if m.params] if skip_empty else found

