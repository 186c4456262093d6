"""The state dicts of FullyShardedDataParallel: full and local model state, and optimizer state.

:class:`StateDictMixin` is a base class of
:class:`fairscale.nn.data_parallel.fully_sharded_data_parallel.FullyShardedDataParallel` (it holds
no state of its own and is not meant for other classes); its methods are FSDP's public
state-dict API:

- ``state_dict()`` / ``load_state_dict()`` use the unwrapped model's keys and gather or scatter
  the full tensors through ``summon_full_params`` (collective: every rank must call them). A plain
  parent module loading a full state dict loads each FSDP child's part with the child's own keys.
- ``local_state_dict()`` / ``load_local_state_dict()`` hold this rank's shards, keyed by clean
  paths as in FairScale 0.4.13 (``layers.0.flat_param_0``; no communication); ``consolidate_shard_weights`` turns every rank's local state dict and
  ``local_metadata_dict()`` back into a full state dict offline.
- ``gather_full_optim_state_dict`` / ``get_shard_from_optim_state_dict`` convert the optimizer's
  state between the shards and FairScale 0.4.13's full layout (:mod:`fairscale.nn.data_parallel.fsdp_optim`).

The bookkeeping behind them (key cleaning, metadata, consolidation, optimizer state) is in
:mod:`fairscale.nn.data_parallel.fsdp_state`.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, ContextManager, Iterator, Mapping

import torch
from torch import nn

from fairscale.nn.data_parallel import fsdp_optim, fsdp_state
from fairscale.nn.misc.flatten_params_wrapper import clean_key

# the class that mixes this in (it imports this module, so it is not imported back)
FullyShardedDataParallel = Any

__all__ = ["StateDictMixin"]


class StateDictMixin(nn.Module):
    """State-dict methods of FullyShardedDataParallel (see the module docstring)."""

    if TYPE_CHECKING:  # provided by FullyShardedDataParallel
        rank: int
        state_dict_on_rank_0_only: bool
        state_dict_device: torch.device | None
        _local_mode: bool
        _summoned: int

        def summon_full_params(self, recurse: bool = True, volatile: bool = False) -> ContextManager[None]: ...

        def _instances(self) -> Iterator[tuple[str, FullyShardedDataParallel]]: ...

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The full state dict with the unwrapped module's keys (collective)."""
        if args or self._local_mode or self._summoned:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        with self.summon_full_params(recurse=True, volatile=True):
            tmp = super().state_dict(keep_vars=False)
        out = OrderedDict() if destination is None else destination
        if self.state_dict_on_rank_0_only and self.rank != 0:
            return out
        dtypes = fsdp_state.buffer_dtypes(self)
        for key, value in tmp.items():
            key = clean_key(key)
            value = value.detach().clone()
            if key in dtypes:
                value = value.to(dtypes[key])
            if self.state_dict_device is not None:
                value = value.to(self.state_dict_device)
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a full state dict (unwrapped keys) into the shards (collective)."""
        if self._local_mode:
            return super().load_state_dict(state_dict, strict=strict)
        with self.summon_full_params(recurse=True, volatile=False):
            actual = {clean_key(k): k for k in super().state_dict(keep_vars=True)}
            mapped = {actual.get(k, k): v for k, v in state_dict.items()}
            result = super().load_state_dict(mapped, strict=strict)
        result.missing_keys[:] = [clean_key(k) for k in result.missing_keys]
        result.unexpected_keys[:] = [clean_key(k) for k in result.unexpected_keys]
        return result

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        if self._local_mode or self._summoned:  # inside our own load: plain loading
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
            return
        # a plain parent module is loading a full state dict: load our part with our own keys, then
        # leave our local keys in its place so the parent's recursion into our children is a no-op
        ours = [k for k in state_dict if k.startswith(prefix)]
        result = self.load_state_dict({k[len(prefix):]: state_dict.pop(k) for k in ours}, strict=False)
        missing_keys.extend(prefix + k for k in result.missing_keys)
        unexpected_keys.extend(prefix + k for k in result.unexpected_keys)
        state_dict.update({prefix + k: v for k, v in self._raw_local_state_dict(keep_vars=True).items()})

    @contextlib.contextmanager
    def _local_state(self) -> Iterator[None]:
        instances = [m for _, m in self._instances()]
        for m in instances:
            m._local_mode = True
        try:
            yield
        finally:
            for m in instances:
                m._local_mode = False

    def _raw_local_state_dict(self, **kwargs: Any) -> Any:
        """This rank's shards and the buffers under the module tree's own keys (wrapper levels kept)."""
        with self._local_state():
            return nn.Module.state_dict(self, **kwargs)  # not self.state_dict: a subclass may route it here

    def local_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's shards and the buffers (no communication), keyed as FairScale 0.4.13 keys them:
        wrapper levels removed, e.g. ``layers.0.flat_param_0`` and ``layers.0.norm.running_mean``."""
        if args:  # torch's deprecated positional (destination, prefix, keep_vars)
            kwargs.update(zip(("destination", "prefix", "keep_vars"), args))
        destination, prefix = kwargs.pop("destination", None), kwargs.pop("prefix", "")
        raw = self._raw_local_state_dict(**kwargs)
        out = OrderedDict() if destination is None else destination
        for key, value in raw.items():
            out[prefix + clean_key(key)] = value
        return out

    def load_local_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load what :meth:`local_state_dict` returned on this rank (clean keys, or wrapper keys)."""
        actual = {clean_key(k): k for k in self._raw_local_state_dict(keep_vars=True)}
        mapped = {actual.get(k, k): v for k, v in state_dict.items()}
        with self._local_state():
            result = nn.Module.load_state_dict(self, mapped, strict=strict)
        result.missing_keys[:] = [clean_key(k) for k in result.missing_keys]
        result.unexpected_keys[:] = [clean_key(k) for k in result.unexpected_keys]
        return result

    def local_metadata_dict(self) -> dict[str, Any]:
        """What :meth:`consolidate_shard_weights` needs to rebuild full tensors from local state dicts."""
        return fsdp_state.metadata(self)

    @staticmethod
    def consolidate_shard_weights(shard_weights: list[dict[str, torch.Tensor]], shard_metadata: list[dict[str, Any]],
                                  with_module_buffers: bool = True, strict: bool = True) -> dict[str, torch.Tensor]:
        """Full state dict (unwrapped keys) from every rank's ``local_state_dict()`` and
        ``local_metadata_dict()``, in rank order; no process group needed."""
        return fsdp_state.consolidate(shard_weights, shard_metadata, with_module_buffers=with_module_buffers,
                                      strict=strict)

    # ---------------------------------------------------------------------------------------------
    # optimizer state

    def gather_full_optim_state_dict(self, optim: torch.optim.Optimizer, **ignored: Any) -> dict[str, Any] | None:
        """The optimizer's state unflattened and unsharded, in FairScale 0.4.13's layout (see
        :mod:`fairscale.nn.data_parallel.fsdp_optim`: original parameters numbered instance by
        instance, ``param_id_map``, ``uncollected_local_ids``). Collective; returned on rank 0,
        None elsewhere. The optimizer's own state is not changed."""
        full = fsdp_optim.gather_optim(self, optim)
        return full if self.rank == 0 else None

    def get_shard_from_optim_state_dict(self, full_optim_state_dict: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of a full optimizer state dict, for an optimizer over ``self.parameters()``."""
        return fsdp_optim.shard_optim(self, full_optim_state_dict)
