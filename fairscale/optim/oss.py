"""OSS: ZeRO stage 1, FairScale 0.4.13's ``fairscale.optim.OSS``, on our ``passes.ops.comm`` collectives.

Each rank owns a partition of the parameters, keeps optimizer state only for those, steps only
those, and then broadcasts the updated values from their owners (Rajbhandari et al. 2020, "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", section 5.1, P_os)::

    import torch
    from fairscale.optim import OSS

    optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)
    loss = model(batch).sum(); loss.backward()      # gradients all-reduced (DDP) or reduced (SDP)
    optimizer.step()

``optimizer.param_groups`` are the full groups (every parameter), so learning-rate schedulers and
hyper-parameter edits work unchanged; they are copied to the rank-local optimizer at each step.
"""

from __future__ import annotations

import copy
import io
import warnings
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from fairscale.internal.params import calc_grad_norm
from fairscale.nn.misc.param_bucket import ParamBucket
from passes.ops import comm  # (its import binds torch.distributed.nn defaults early: see there)

__all__ = ["OSS", "axis_for_group", "broadcast_object", "collective_device"]

_HYPER_SKIP = ("params",)


def axis_for_group(group: Any, prefix: str = "zero") -> str:
    """Register ``group`` (``None`` = the world) in ``passes.ops.comm`` under a stable axis name."""
    if group is None or group is dist.group.WORLD:
        name, pg = prefix, dist.group.WORLD
    else:
        ranks = dist.get_process_group_ranks(group)
        name, pg = f"{prefix}[{','.join(map(str, ranks))}]", group
    comm.set_group(name, pg if dist.get_world_size(pg) > 1 else None)
    return name


def collective_device(axis: str) -> torch.device:
    """Where tensors for ``axis``'s collectives must live: this rank's GPU under NCCL, else the CPU."""
    group = comm.get_group(axis)
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(obj: Any, axis: str, *, src_rank: int) -> Any:
    """Broadcast a picklable object from axis-local ``src_rank`` through the counted collectives
    (as bytes on the group's device; tensors inside come back where they were saved)."""
    if comm.group_size(axis) == 1:
        return obj
    device = collective_device(axis)
    mine = comm.group_rank(axis) == src_rank
    if mine:
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel()], dtype=torch.long, device=device)
    else:
        size = torch.zeros(1, dtype=torch.long, device=device)
    comm.broadcast_(size, axis, src_rank=src_rank)
    if not mine:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    comm.broadcast_(data, axis, src_rank=src_rank)
    if mine:
        return obj
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=False)


def _broadcast_async(t: torch.Tensor, axis: str, src_rank: int) -> Any:
    """``comm.broadcast_`` without waiting: same byte accounting (``B`` per rank), returns the Work."""
    n = comm.group_size(axis)
    if n == 1:
        return None
    group = comm.get_group(axis)
    nbytes = t.numel() * t.element_size()
    comm.count("broadcast", axis, nbytes, comm.ring_bytes("broadcast", nbytes, n))
    return dist.broadcast(t, src=dist.get_global_rank(group, src_rank), group=group, async_op=True)


class OSS(torch.optim.Optimizer):
    """Optimizer state sharding (ZeRO-1) wrapping any ``torch.optim`` optimizer class.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        optim: the optimizer class each rank builds over its own shard (default SGD).
        group: the process group to shard over (default: the world).
        broadcast_buffer_size: bytes per broadcast bucket; small parameters owned by the same
            rank travel together in one flat buffer up to this size (FairScale 0.4.13 deprecated
            the argument; its default -1 means 2**24 bytes here).
        broadcast_fp16: broadcast updated parameters as fp16 (halves the traffic, rounds the
            copies that non-owners receive; the owner keeps its exact values).
        force_broadcast_object: FairScale sent consolidated state as pickled objects only when
            asked (else as tensors under NCCL); here it always does, so the flag changes nothing.
            It is not passed to ``optim``.
        optim_kwargs: passed to ``optim`` (``lr``, ``momentum``, ...).

    Partitioning is FairScale 0.4.13's greedy rule: inside each group, in the group's order, each
    parameter goes to the rank with the fewest elements so far (a frozen parameter counts as one
    element; sizes carry over between groups).
    """

    def __init__(self, params: Iterable[Any], optim: type[torch.optim.Optimizer] = torch.optim.SGD,
                 group: Any = None, broadcast_buffer_size: int = -1, broadcast_fp16: bool = False,
                 force_broadcast_object: bool = False, **optim_kwargs: Any) -> None:
        if not dist.is_initialized():
            raise RuntimeError("OSS needs torch.distributed initialized (use fairscale.launch or torchrun)")
        if broadcast_buffer_size < 0:
            broadcast_buffer_size = 2**24
        super().__init__(params, dict(optim_kwargs))
        self.group = dist.group.WORLD if group is None else group
        self.axis = axis_for_group(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.global_rank = dist.get_rank()
        self.broadcast_buffer_size = int(broadcast_buffer_size)
        self.broadcast_fp16 = bool(broadcast_fp16)
        self.force_broadcast_object = bool(force_broadcast_object)
        self._optim_cls = optim
        self._optim_kwargs = dict(optim_kwargs)
        self._partition: list[list[dict[str, Any]]] | None = None
        self._param_to_rank: dict[torch.Tensor, int] = {}
        self._sizes = [0] * self.world_size
        self.optim = self._build_local_optimizer()
        self._all_states: list[dict[str, Any]] = []
        self._buckets: list[tuple[int, list[torch.Tensor], torch.Tensor | None]] | None = None
        self._bucket_trainable: tuple[bool, ...] = ()

    # -------------------------------------------------------------------------------- partition

    def _assign(self, group: dict[str, Any]) -> list[list[torch.Tensor]]:
        owned: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
        for p in group["params"]:
            r = self._sizes.index(min(self._sizes))
            # the optimizer state is what is sharded: trainable parameters count by size, frozen
            # ones are spread one by one
            self._sizes[r] += p.numel() if p.requires_grad else 1
            self._param_to_rank[p] = r
            owned[r].append(p)
        return owned

    def partition_parameters(self) -> list[list[dict[str, Any]]]:
        """Per rank, the list of its param groups (same hyper-parameters, only the owned params)."""
        if self._partition is None:
            self._partition = [[] for _ in range(self.world_size)]
            self._sizes = [0] * self.world_size
            self._param_to_rank = {}
            for group in self.param_groups:
                self._append_group_partition(group)
        return self._partition

    def _append_group_partition(self, group: dict[str, Any]) -> None:
        assert self._partition is not None
        for r, ps in enumerate(self._assign(group)):
            g = {k: v for k, v in group.items() if k != "params"}
            g["params"] = ps
            self._partition[r].append(g)

    @property
    def param_to_rank(self) -> dict[torch.Tensor, int]:
        """Owner rank (inside ``group``) of every parameter."""
        self.partition_parameters()
        return self._param_to_rank

    @property
    def per_device_params(self) -> list[list[torch.Tensor]]:
        """Per rank, the flat list of parameters it owns."""
        return [[p for g in groups for p in g["params"]] for groups in self.partition_parameters()]

    @property
    def _per_device_params(self) -> dict[torch.device, list[list[torch.Tensor]]]:
        """FairScale 0.4.13's view of the partition, which clients read: per device (in the order
        devices first appear), per rank, the parameters sorted by size (stable)."""
        out: dict[torch.device, list[list[torch.Tensor]]] = {}
        for g in self.param_groups:
            for p in g["params"]:
                out.setdefault(p.device, [[] for _ in range(self.world_size)])[self.param_to_rank[p]].append(p)
        for lists in out.values():
            for ps in lists:
                ps.sort(key=lambda q: q.numel())
        return out

    def _owned_in_0413_order(self) -> list[torch.Tensor]:
        """This rank's parameters in 0.4.13's ``_local_params`` order (per device, by size): the
        order of the per-parameter norms in ``clip_grad_norm`` decides the last bit of the total."""
        return [p for lists in self._per_device_params.values() for p in lists[self.rank]]

    def _build_local_optimizer(self) -> torch.optim.Optimizer:
        self._partition = None
        local = self.partition_parameters()[self.rank]
        return self._optim_cls(local, **self._optim_kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if getattr(self, "optim", None) is None:  # called by Optimizer.__init__
            return
        self._append_group_partition(self.param_groups[-1])
        self.optim.add_param_group(self._partition[self.rank][-1])  # type: ignore[index]
        self._buckets = None

    def refresh_trainable(self) -> None:
        """Rebuild the broadcast buckets after parameters changed ``requires_grad`` (only trainable
        parameters are broadcast). The partition itself covers every parameter, trainable or not,
        so ownership and optimizer state are unaffected."""
        self._buckets = None

    # -------------------------------------------------------------------------------- step

    def _sync_hyperparameters(self) -> None:
        for gg, lg in zip(self.param_groups, self.optim.param_groups):
            for k, v in gg.items():
                if k not in _HYPER_SKIP:
                    lg[k] = v

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> Any:
        """Step the owned shard, then broadcast every parameter from its owner."""
        self._sync_hyperparameters()
        loss = self.optim.step(closure=closure, **kwargs) if closure is not None or kwargs else self.optim.step()
        for gg, lg in zip(self.param_groups, self.optim.param_groups):
            for k, v in lg.items():  # an optimizer may adapt its own hyper-parameters
                if k not in _HYPER_SKIP:
                    gg[k] = v
        self._broadcast_params()
        return loss

    def _bucketize(self) -> list[tuple[int, list[torch.Tensor], torch.Tensor | None]]:
        """Group each owner's trainable parameters into buckets of at most ``broadcast_buffer_size``
        bytes. A bucket of several parameters gets one flat buffer and its parameters become views
        into it (as FairScale's parameter buckets), so the broadcast moves the buffer in place with
        no copies; with ``broadcast_fp16`` the buffer is a half-precision copy instead."""
        groups: list[tuple[int, list[torch.Tensor]]] = []
        for r, params in enumerate(self.per_device_params):
            cur: list[torch.Tensor] = []
            size = 0
            for p in params:
                if not p.requires_grad:  # frozen: never updated, nothing to broadcast
                    continue
                nbytes = p.numel() * p.element_size()
                if cur and (size + nbytes > self.broadcast_buffer_size or p.dtype != cur[0].dtype
                            or p.device != cur[0].device):
                    groups.append((r, cur))
                    cur, size = [], 0
                cur.append(p)
                size += nbytes
            if cur:
                groups.append((r, cur))
        buckets: list[tuple[int, list[torch.Tensor], torch.Tensor | None]] = []
        for r, params in groups:
            flat = None
            fp16 = self.broadcast_fp16 and params[0].dtype == torch.float32
            if len(params) > 1 and not fp16:
                bucket = ParamBucket(sum(p.numel() for p in params), params[0].dtype, params[0].device)
                for p in params:
                    bucket.add_param(p)
                flat = bucket.buffer
            buckets.append((r, params, flat))
        return buckets

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        """Every bucket's broadcast is issued asynchronously, then all are awaited (they overlap).
        With ``broadcast_fp16`` every rank, the owner included, reads the half-precision copy back,
        so all hold the same fp16-rounded weights, as FairScale 0.4.13 (whose fp16 buckets held
        every trainable parameter, its owner's too; on one rank as well)."""
        if self.world_size == 1:
            if self.broadcast_fp16:
                for g in self.param_groups:
                    for p in g["params"]:
                        if p.requires_grad and p.dtype == torch.float32:
                            p.data.copy_(p.data.half())
            return
        trainable = tuple(p.requires_grad for g in self.param_groups for p in g["params"])
        if self._buckets is None or trainable != self._bucket_trainable:  # (un)frozen since: rebuild
            self._buckets, self._bucket_trainable = self._bucketize(), trainable
        pending: list[tuple[Any, int, list[torch.Tensor], torch.Tensor | None]] = []
        for owner, params, flat in self._buckets:
            if flat is not None:  # parameters are views into it: broadcast in place
                pending.append((_broadcast_async(flat, self.axis, owner), owner, params, None))
                continue
            if len(params) == 1 and not (self.broadcast_fp16 and params[0].dtype == torch.float32):
                pending.append((_broadcast_async(params[0].data, self.axis, owner), owner, params, None))
                continue
            # broadcast_fp16: a half-precision copy travels; every rank reads it back
            if owner == self.rank:
                half = torch.cat([p.detach().reshape(-1) for p in params]).half()
            else:
                half = torch.empty(sum(p.numel() for p in params), device=params[0].device, dtype=torch.float16)
            pending.append((_broadcast_async(half, self.axis, owner), owner, params, half))
        for work, owner, params, received in pending:
            if work is not None:
                work.wait()
            if received is None:
                continue
            offset = 0
            for p in params:
                n = p.numel()
                p.data.copy_(received[offset:offset + n].view_as(p))
                offset += n

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the gradients of every parameter, owned or not."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    # -------------------------------------------------------------------------------- clipping

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0,
                       filter_params_fn: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
                       ) -> torch.Tensor:
        """Clip gradients by the norm over **all** shards; returns that total norm.

        Each rank measures only the parameters it owns (their gradients are the reduced ones), so
        no element is counted twice, and scales only those. As in FairScale 0.4.13 the partial norms
        are combined over the whole world, not ``group`` (with model parallelism, pick each rank's
        share with ``filter_params_fn``), in its arithmetic: the norm of the per-parameter float32
        norms, raised to ``norm_type``, all-reduced, and the coefficient ``max_norm / (norm + 1e-6)``
        as a tensor division.
        """
        max_norm, norm_type = float(max_norm), float(norm_type)
        owned = [p for p in self._owned_in_0413_order() if p.grad is not None]
        local = filter_params_fn(owned) if filter_params_fn is not None else owned
        world = axis_for_group(None)
        device = collective_device(world)  # the all-reduce's device (the GPU under NCCL)
        total_norm = calc_grad_norm(local, norm_type).to(device)
        if norm_type == float("inf"):
            comm.all_reduce_(total_norm, world, op=dist.ReduceOp.MAX)
        else:
            total_norm = total_norm ** norm_type
            comm.all_reduce_(total_norm, world)
            total_norm = total_norm ** (1.0 / norm_type)
        clip_coef = torch.tensor(max_norm, dtype=total_norm.dtype, device=total_norm.device) / (total_norm + 1e-6)
        if clip_coef < 1:
            for p in owned:
                p.grad.detach().mul_(clip_coef.to(p.grad.device))
        return total_norm

    # -------------------------------------------------------------------------------- state dicts

    def _local_to_global_index(self) -> dict[int, int]:
        """Index of each locally owned parameter (local optimizer numbering) in the global numbering."""
        glob = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        local = [p for g in self.optim.param_groups for p in g["params"]]
        return {i: glob[id(p)] for i, p in enumerate(local)}

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather every shard's optimizer state on ``recipient_rank`` (every rank must call this)."""
        self._sync_hyperparameters()
        mine = copy.deepcopy(self.optim.state_dict())  # a snapshot: later steps must not change it
        mine = {"state": {self._local_to_global_index()[k]: v for k, v in mine["state"].items()}}
        self._all_states = []
        for r in range(self.world_size):
            got = broadcast_object(mine if r == self.rank else None, self.axis, src_rank=r) \
                if self.world_size > 1 else mine
            if self.rank == recipient_rank:
                self._all_states.append(got)

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        """The full optimizer state, in the plain ``torch.optim`` format (global parameter indices).

        Call :meth:`consolidate_state_dict` first; only its recipient holds the state
        (``all_ranks=True`` consolidates to every rank here, a collective call).
        """
        if all_ranks:
            states = []
            for r in range(self.world_size):
                self.consolidate_state_dict(recipient_rank=r)
                if r == self.rank:
                    states = self._all_states
            self._all_states = states
        if not self._all_states:
            raise RuntimeError("OSS.state_dict(): call consolidate_state_dict(recipient_rank) on every rank "
                               "first; the full state is only built on the recipient rank")
        state: dict[int, Any] = {}
        for shard in self._all_states:
            state.update(shard["state"])
        state = dict(sorted(state.items()))  # in parameter order, as 0.4.13 and a plain optimizer
        groups, start = [], 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(d)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (from :meth:`state_dict` or a plain torch optimizer); each rank keeps its shard."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(groups)} param groups, this optimizer {len(self.param_groups)}")
        for gg, sg in zip(self.param_groups, groups):
            if len(gg["params"]) != len(sg["params"]):
                raise ValueError("a param group in the state dict has a different number of parameters")
            for k, v in sg.items():
                if k != "params":
                    gg[k] = v
        glob_ids = [i for sg in groups for i in sg["params"]]
        l2g = self._local_to_global_index()
        local_state = {li: state_dict["state"][glob_ids[gi]] for li, gi in l2g.items()
                       if glob_ids[gi] in state_dict["state"]}
        local_groups = []
        count = 0
        for lg, sg in zip(self.optim.param_groups, groups):
            d = {k: v for k, v in sg.items() if k != "params"}
            d["params"] = list(range(count, count + len(lg["params"])))
            count += len(lg["params"])
            local_groups.append(d)
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self._sync_hyperparameters()

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The rank-local optimizer's state (only the owned parameters)."""
        return self.optim.state

    @state.setter
    def state(self, value: Any) -> None:
        if getattr(self, "optim", None) is not None:
            warnings.warn("OSS.state is the local shard's state and cannot be replaced; use load_state_dict")
