"""FullyShardedDataParallel: FairScale 0.4.13's FSDP (ZeRO-3) on our runtime, CPU included.

    import torch
    from fairscale.nn import FullyShardedDataParallel as FSDP, auto_wrap, enable_wrap

    with enable_wrap(wrapper_cls=FSDP, mixed_precision=False):
        model = auto_wrap(model)            # inner instances own their blocks' parameters
    model = FSDP(model)                     # the root owns the rest
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for batch in loader:
        opt.zero_grad(set_to_none=True)
        model(batch).sum().backward()       # grads arrive reduce-scattered into the shards
        model.clip_grad_norm_(1.0)
        opt.step()

Each instance flattens the parameters it owns (those not inside a nested instance) into a flat
parameter, zero-pads it to a multiple of the group size n and keeps only this rank's 1/n: the
tensor the optimizer sees. Forward all-gathers it (in ``compute_dtype``), binds views of the
gathered tensor under the original attribute names and runs the module; backward reduce-scatters
the gradient into the shard's ``.grad`` (summed over ranks, divided by n: the data-parallel mean).
The collectives are ``passes.ops.dp_ops``'s, on a process group registered under a unique axis name
with ``passes.ops.comm``, so their bytes are counted with everything else.

Keys: ``state_dict()`` / ``load_state_dict()`` use the unwrapped model's keys (collective: every
rank must call them). ``local_state_dict()`` holds the shards; ``consolidate_shard_weights`` turns
every rank's local state dict and ``local_metadata_dict()`` back into a full state dict offline.

Modules: this file holds the wrapper itself (construction, forward, full parameters, clipping).
The state-dict methods, for the model and the optimizer, come from the base class in
:mod:`fairscale.nn.data_parallel.fsdp_state_dict`; ownership, metadata, consolidation and
optimizer-state bookkeeping live in :mod:`fairscale.nn.data_parallel.fsdp_state`, and the
flat-parameter units with their gather and backward hooks in :mod:`fairscale.nn.data_parallel.fsdp_units`.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import warnings
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fairscale.internal.parallel import ProcessGroupName
from fairscale.nn.data_parallel import fsdp_state
from fairscale.nn.data_parallel.fsdp_state_dict import StateDictMixin
from fairscale.nn.data_parallel.fsdp_units import gather_full, make_units, pre_backward, scale_grads
from fairscale.nn.misc.flatten_params_wrapper import (
    FlattenParamsWrapper,
    bind_views,
    build_groups,
    clean_key,
)
from passes.ops import comm, dp_ops

__all__ = ["FullyShardedDataParallel", "TrainingState"]

_AXES = itertools.count()
_FORWARD_DEPTH = [0]
_WARNED: set[str] = set()


class TrainingState(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    leaves, spec = tree_flatten(tree)
    leaves = [x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in leaves]
    return tree_unflatten(leaves, spec)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class FullyShardedDataParallel(StateDictMixin, nn.Module):
    """Shard ``module``'s parameters, gradients and optimizer state over ``process_group``.

    Args:
        module: the module to wrap; nested instances inside it keep their own parameters.
        process_group: the group to shard over (default: the world; a single process when
            torch.distributed is not initialized; a size-1 stand-in with ``rank()``/``size()`` works).
        process_group_reduce_scatter: FairScale's second group for overlapped reduce-scatters; any
            group over the same ranks is accepted and the reduce-scatters run on ``process_group``.
        reshard_after_forward: free the gathered parameters after forward and gather them again in
            backward (less memory, one more all-gather).
        disable_reshard_on_root: the root instance keeps its parameters between forward and backward.
        mixed_precision: compute in ``compute_dtype`` (default fp16) with fp32 master shards;
            floating inputs of the root and buffers are cast.
        fp32_reduce_scatter: reduce gradients in fp32 (else in the compute dtype).
        flatten_parameters: one flat parameter per instance (else each parameter is sharded on its
            own and keeps its name in ``named_parameters()``).
        move_params_to_cpu: keep the fp32 shards (and so the optimizer step) on the CPU; gathers
            copy them to ``compute_device``. ``cpu_offload`` is its old name.
        compute_dtype: dtype of forward/backward compute (default fp16 if mixed_precision else the
            parameters' dtype).
        buffer_dtype: dtype of buffers (default ``compute_dtype``).
        move_grads_to_cpu: gradient shards live on the CPU; must match ``move_params_to_cpu``
            because gradients live with their shards (default: ``move_params_to_cpu``).
        bucket_cap_mb: FairScale's reduce-scatter bucket size. Each instance here reduce-scatters its
            flat parameter in one call (0 = unbucketed, which is what runs); other values warn once.
        compute_device: where forward/backward run (default: the current CUDA device, or the CPU
            when there is no GPU).
        no_broadcast_optim_state: this instance's optimizer state is rank-local (a group of size 1,
            e.g. MoE experts); ``gather_full_optim_state_dict`` takes it as is.
        state_dict_device: device of ``state_dict()`` tensors (default: where the shards live).
        clear_autocast_cache: call ``torch.clear_autocast_cache()`` after each forward.
        force_input_to_fp32: cast floating inputs to fp32 (when mixed_precision is off).
        verbose: longer ``repr``.
        cpu_offload: alias of ``move_params_to_cpu``.
        state_dict_on_rank_0_only: ``state_dict()`` returns the tensors on rank 0 and an empty
            dict elsewhere (every rank still takes part in the gather).
        gradient_predivide_factor: divide gradients by this before the reduce-scatter (against
            fp16 overflow in the sum); the total division is still by n (the rest after the
            reduction, the compensating multiplication in the fp32 master dtype).
        allow_reset_parameters: allow ``reset_parameters()`` inside ``summon_full_params()``.
    """

    def __init__(self, module: nn.Module, process_group: Any = None,
                 process_group_reduce_scatter: Any = ProcessGroupName.reduce_scatter, reshard_after_forward: bool = True,
                 disable_reshard_on_root: bool = True, mixed_precision: bool = False,
                 fp32_reduce_scatter: bool = False, flatten_parameters: bool = True,
                 move_params_to_cpu: bool = False, compute_dtype: torch.dtype | None = None,
                 buffer_dtype: torch.dtype | None = None, move_grads_to_cpu: bool | None = None,
                 bucket_cap_mb: int = 25, compute_device: Any = None, no_broadcast_optim_state: bool = False,
                 state_dict_device: Any = None, clear_autocast_cache: bool = False,
                 force_input_to_fp32: bool = False, verbose: bool = False, cpu_offload: bool = False,
                 state_dict_on_rank_0_only: bool = False, gradient_predivide_factor: float | None = None,
                 allow_reset_parameters: bool = False) -> None:
        super().__init__()
        self.process_group, self.world_size, self.rank = fsdp_state.resolve_group(process_group)
        fsdp_state.check_reduce_scatter_group(process_group_reduce_scatter, self.process_group, self.world_size)
        self.process_group_reduce_scatter = self.process_group  # see check_reduce_scatter_group
        self._axis = f"fsdp{next(_AXES)}"
        comm.set_group(self._axis, self.process_group if self.world_size > 1 else None)

        self.reshard_after_forward = bool(reshard_after_forward)
        self.disable_reshard_on_root = bool(disable_reshard_on_root)
        self.mixed_precision = bool(mixed_precision)
        self.fp32_reduce_scatter = bool(fp32_reduce_scatter)
        self.flatten_parameters = bool(flatten_parameters)
        self.move_params_to_cpu = bool(move_params_to_cpu or cpu_offload)
        self.move_grads_to_cpu = self.move_params_to_cpu if move_grads_to_cpu is None else bool(move_grads_to_cpu)
        self.compute_device = torch.device(compute_device) if compute_device is not None else _default_device()
        if self.compute_device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"compute_device={self.compute_device} but CUDA is not available; leave compute_device "
                             "unset (it defaults to the CPU without a GPU) or pass 'cpu'")
        if self.compute_device.type != "cpu" and self.move_grads_to_cpu != self.move_params_to_cpu:
            raise ValueError(f"move_grads_to_cpu={self.move_grads_to_cpu} with move_params_to_cpu="
                             f"{self.move_params_to_cpu}: gradient shards live on the device of their parameter "
                             "shards here; pass the same value for both")
        if compute_dtype not in (None, torch.float32) and not self.mixed_precision:
            raise ValueError(f"compute_dtype={compute_dtype} needs mixed_precision=True (fp32 master shards, "
                             f"{compute_dtype} compute); to train in {compute_dtype} end to end, cast the module first")
        self.compute_dtype = (compute_dtype or torch.float16) if self.mixed_precision else None
        self.buffer_dtype = buffer_dtype or self.compute_dtype
        self.bucket_cap_mb = bucket_cap_mb
        self.no_broadcast_optim_state = bool(no_broadcast_optim_state)
        if self.no_broadcast_optim_state and self.world_size > 1:
            raise ValueError(f"no_broadcast_optim_state=True needs a process group of size 1 (its optimizer state "
                             f"is rank-local), got size {self.world_size}")
        self.state_dict_device = torch.device(state_dict_device) if state_dict_device is not None else None
        self.clear_autocast_cache = bool(clear_autocast_cache)
        self.force_input_to_fp32 = bool(force_input_to_fp32)
        self.verbose = bool(verbose)
        self.state_dict_on_rank_0_only = bool(state_dict_on_rank_0_only)
        self.gradient_predivide_factor = gradient_predivide_factor
        self.allow_reset_parameters = bool(allow_reset_parameters)
        if bucket_cap_mb not in (0, 25):
            _warn_once("bucket", f"FullyShardedDataParallel: bucket_cap_mb={bucket_cap_mb} is not applied: each instance "
                       "reduce-scatters its flat parameter in one call as soon as its gradient is ready (unbucketed, "
                       "as bucket_cap_mb=0); wrap smaller or larger submodules to change the message size.")

        self._is_root: bool | None = None
        self.training_state = TrainingState.IDLE
        self._summoned = 0
        self._local_mode = False
        self.__dict__["_summon_fulls"] = []  # this instance's gathered full tensors while summoned
        self._build(module)
        if gradient_predivide_factor not in (None, 1):
            if gradient_predivide_factor <= 0:
                raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
            for u in self._units:
                if u.flat.requires_grad:  # the reduce-scatter divided by n: undo the predivision
                    u.flat.register_hook(lambda g, f=float(gradient_predivide_factor): g * f)

    # ---------------------------------------------------------------------------------------------
    # construction

    def _build(self, module: nn.Module) -> None:
        owned, self._original_refs, self._orig_names = fsdp_state.collect_owned(module, FullyShardedDataParallel)
        if self.flatten_parameters:
            trainable = [p for p in owned if p.requires_grad]
            frozen = [p for p in owned if not p.requires_grad]
            lists = [g for g in (trainable, frozen) if g]
            dtypes = {p.dtype for p in owned}
            if len(dtypes) > 1:  # one flat parameter per dtype and grad flag
                lists = [[p for p in g if p.dtype == d] for g in lists for d in sorted(dtypes, key=str)]
                lists = [g for g in lists if g]
            fpw = FlattenParamsWrapper(module, param_list=lists)
            groups = list(fpw._groups)
            fulls = [p.detach() for p in fpw.flat_params]
            names: list[str | None] = list(fpw._flat_names)
        else:
            fpw = FlattenParamsWrapper(module, param_list=[])
            groups = build_groups(module, [[p] for p in owned], skip=(FullyShardedDataParallel,))
            fulls = [p.detach() for p in owned]
            names = [None] * len(owned)
        fpw._unflat_state_dict = False
        self._fsdp_wrapped_module = fpw

        shard_device = torch.device("cpu") if self.move_params_to_cpu else self.compute_device
        units = make_units(groups, fulls, names, fpw, n=self.world_size, rank=self.rank, axis=self._axis,
                           compute_dtype=self.compute_dtype if self.mixed_precision else None,
                           fp32_reduce_scatter=self.fp32_reduce_scatter, reshard=self.reshard_after_forward,
                           compute_device=self.compute_device, shard_device=shard_device)
        self.__dict__["_units"] = units  # not submodules: their tensors are registered where shown above
        self._bind_placeholders()
        fsdp_state.prepare_buffers(module, FullyShardedDataParallel, self.buffer_dtype if self.mixed_precision else None,
                                   self.compute_device)

    def _bind_placeholders(self) -> None:
        """Outside forward, the original attributes hold data-less meta tensors of the right shape
        and dtype: code that inspects them (repr, ``.shape``) works, code that computes with them
        fails loudly instead of reading stale values."""
        for u in self._units:
            bind_views(u.group, [torch.empty(shape, dtype=u.op.param_dtype, device="meta")
                                 for _, shape in u.group.members])

    # ---------------------------------------------------------------------------------------------
    # module plumbing

    @property
    def module(self) -> FlattenParamsWrapper:
        """The FlattenParamsWrapper around the user's module (``.module`` again for the user's)."""
        return self._fsdp_wrapped_module

    @property
    def params(self) -> list[nn.Parameter]:
        """This instance's own shard parameters (not nested instances'), as FairScale's ``params``."""
        return [u.flat for u in self._units]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_fsdp_wrapped_module":
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: Any) -> Any:
        return self._fsdp_wrapped_module.module[key]  # type: ignore[index]  # a Sequential, when indexed

    def extra_repr(self) -> str:
        s = (f"world_size={self.world_size}, flatten_parameters={self.flatten_parameters}, "
             f"mixed_precision={self.mixed_precision}, reshard_after_forward={self.reshard_after_forward}")
        if self.verbose:
            s += (f", rank={self.rank}, axis={self._axis!r}, compute_dtype={self.compute_dtype}, "
                  f"buffer_dtype={self.buffer_dtype}, fp32_reduce_scatter={self.fp32_reduce_scatter}, "
                  f"compute_device={self.compute_device}, move_params_to_cpu={self.move_params_to_cpu}, "
                  f"units={[(u.layout.numel, u.layout.padded) for u in self._units]}")
        return s

    def _instances(self) -> Iterator[tuple[str, FullyShardedDataParallel]]:
        for name, m in self.named_modules():
            if isinstance(m, FullyShardedDataParallel):
                yield name, m

    def _lazy_init(self) -> None:
        self._is_root = _FORWARD_DEPTH[0] == 0
        if self._is_root:
            for _, m in self._instances():
                if m is not self:
                    m._is_root = False

    # ---------------------------------------------------------------------------------------------
    # forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._summoned:
            raise RuntimeError("FullyShardedDataParallel: forward inside summon_full_params() is not supported; "
                               "exit the context first")
        if self._is_root is None:
            self._lazy_init()
        if self._is_root and self.mixed_precision and self.compute_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.compute_dtype)
        elif self.force_input_to_fp32 and not self.mixed_precision:
            args, kwargs = _cast_floats((args, kwargs), torch.float32)
        # a checkpoint_wrapper recomputing this forward during backward: the original graph's
        # backward owns freeing; the recomputed outputs are never backpropagated
        recomputing = torch._C._current_graph_task_id() != -1
        pre = self.gradient_predivide_factor
        for u in self._units:
            views = dp_ops.fsdp_unshard(u.op, u.flat)
            if pre not in (None, 1) and u.flat.requires_grad:
                views = scale_grads(views, 1.0 / pre)  # the unit's reduce-scatter then sums g/pre
            bind_views(u.group, views)
        self.training_state = TrainingState.FORWARD
        _FORWARD_DEPTH[0] += 1
        try:
            out = self._fsdp_wrapped_module._fpw_module(*args, **kwargs)
        finally:
            _FORWARD_DEPTH[0] -= 1
            self.training_state = TrainingState.IDLE
        if self.clear_autocast_cache:
            torch.clear_autocast_cache()
        if recomputing or not self._units:
            return out
        leaves, spec = tree_flatten(out)
        idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not torch.is_grad_enabled() or not idx:
            for u in self._units:  # no backward will read them
                u.op.free()
            return out
        free = self.reshard_after_forward and not (self._is_root and self.disable_reshard_on_root)
        new = pre_backward([u.op for u in self._units], free, [leaves[i] for i in idx])
        for i, t in zip(idx, new):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (full size) instead of reduce-scattering them; the first
        backward outside reduces the total. Applies to every FSDP instance of the process."""
        with dp_ops.no_sync():
            yield

    # ---------------------------------------------------------------------------------------------
    # full parameters

    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, volatile: bool = False) -> Iterator[None]:
        """Make the full fp32 parameters visible under their original names (collective).

        Args:
            recurse: also nested instances.
            volatile: discard changes made inside; otherwise each rank writes its shard back.
        """
        if recurse:
            with contextlib.ExitStack() as stack:
                for _, m in self._instances():
                    stack.enter_context(m.summon_full_params(recurse=False, volatile=volatile))
                yield
            return
        if self.training_state == TrainingState.FORWARD or torch._C._current_graph_task_id() != -1:
            raise RuntimeError("summon_full_params() cannot run inside forward or backward")
        if self._summoned:
            self._summoned += 1
            try:
                yield
            finally:
                self._summoned -= 1
            return
        fulls = [gather_full(u) for u in self._units]
        self.__dict__["_summon_fulls"] = fulls
        fpw = self._fsdp_wrapped_module
        saved_data = [u.flat.data for u in self._units]
        with contextlib.ExitStack() as stack:
            flat_units = [(u, f) for u, f in zip(self._units, fulls) if u.flat_name is not None]
            if flat_units:
                stack.enter_context(fpw.unflattened([f[:u.layout.numel] for u, f in flat_units]))
            for u, f in zip(self._units, fulls):
                if u.flat_name is None:
                    u.flat.data = f[:u.layout.numel].view(u.group.members[0][1])
            self._summoned = 1
            self.training_state = TrainingState.SUMMON_FULL_PARAMS
            try:
                yield
            finally:
                self._summoned = 0
                self.training_state = TrainingState.IDLE
                for u, data in zip(self._units, saved_data):
                    u.flat.data = data
                self._bind_placeholders()
        if not volatile:
            with torch.no_grad():
                for u, f in zip(self._units, fulls):
                    lo, hi = u.shard_range()
                    u.flat.copy_(f[lo:hi].view_as(u.flat))  # bumps the version: the next forward gathers afresh
        for u in self._units:
            u.op.free()
        self.__dict__["_summon_fulls"] = []

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """The unwrapped module's names inside ``summon_full_params`` and, as in FairScale 0.4.13,
        always when this instance does not flatten its parameters; a flat parameter's own name
        (``_fsdp_wrapped_module.flat_param_0``) otherwise."""
        clean = self._summoned or not self.flatten_parameters
        for name, p in super().named_parameters(*args, **kwargs):
            yield (clean_key(name) if clean else name), p

    def reset_parameters(self) -> None:
        """Re-initialize the modules this instance owns (only with ``allow_reset_parameters=True``,
        inside ``summon_full_params()``); rank 0's values are broadcast so every rank agrees.
        Nested instances are reset by calling theirs."""
        if not self.allow_reset_parameters:
            raise RuntimeError("reset_parameters() on an FSDP module needs allow_reset_parameters=True")
        if not self._summoned:
            raise RuntimeError("call reset_parameters() inside summon_full_params(): it needs the full parameters")
        for _, m in fsdp_state.walk(self._fsdp_wrapped_module._fpw_module, FullyShardedDataParallel):
            reset = getattr(m, "reset_parameters", None)
            if not isinstance(m, FullyShardedDataParallel) and callable(reset):
                reset()  # writes into this instance's gathered full tensors
        with torch.no_grad():
            for full in self._summon_fulls:
                comm.broadcast_(full, self._axis, src_rank=0)

    # ---------------------------------------------------------------------------------------------
    # clipping

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient norm of the whole (unsharded) model; returns the total norm (collective)."""
        if self._is_root is False:
            raise RuntimeError("clip_grad_norm_ must be called on the root FSDP instance")
        return fsdp_state.clip_grad_norm([p.grad for p in self.parameters() if p.grad is not None], max_norm,
                                         norm_type, axis=self._axis, device=self.compute_device)
