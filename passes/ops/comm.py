"""Collective calls that the passes insert into per-rank graphs, and the counter of what they move.

Graphs refer to process groups by **axis name** (``"dp"``, ``"tp"``, ``"pp"``, or any name a
runtime registers), so a printed rank graph reads ``tp_all_reduce(x, 'tp')``. Each mesh binds
names to real groups in its own table and its module runs under it (:mod:`passes.ops.groups`);
:func:`set_group` binds process-wide groups (classic FairScale modules). An unbound name, or a name
bound to ``None``, is a group of size 1 on which every collective is the identity.

Autograd pairing (Megatron-LM, Shoeybi et al. 2019, section 3; sequence parallelism,
Korthikanti et al. 2022, section 4.2.2)::

    forward                      backward
    copy_to_group    identity     all-reduce        ("f" in Megatron)
    reduce_from_group all-reduce  identity          ("g")
    gather_from_group all-gather  keep own chunk
    scatter_to_group  keep chunk  all-gather
    gather_seq        all-gather  reduce-scatter    (sequence parallel entry)
    reduce_scatter_seq reduce-scatter all-gather    (sequence parallel exit)

Every collective records the bytes it moves per rank in :data:`COUNTER` (and in the active mesh's
own counter), using the ring-algorithm
volume (what NCCL reports as bus bytes): all-reduce 2(n-1)/n·B, all-gather and reduce-scatter
(n-1)/n·B of the full tensor, all-to-all (n-1)/n·B, point-to-point B. Each is also posted to the
flight record (:mod:`passes.ops.flight`) and waited for through it, and asynchronous ones return a
``TracedWork``, so a wait that fails (a timeout under the group's ``collective_timeout_s``, a dead
peer) says what this rank waited for.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from passes.ops import groups
from passes.ops.flight import RECORDER, TracedWork, describe_tensor
from planner.collectives import wire_bytes

# torch.distributed.nn.functional evaluates ``group=group.WORLD`` as default arguments when it is
# first imported, and torch imports it lazily (the first torch optimizer imports torch._dynamo,
# which imports torch.distributed.fsdp -> _shard -> nn.functional), usually after
# init_process_group: the world group is then pinned by those defaults for the life of the process,
# destroy_process_group cannot free it, and its gloo worker threads run on into interpreter exit,
# where a worker that drops a finished collective's tensors needs the GIL and aborts the process
# ("terminate called without an active exception"). Imported here, before any group exists, the
# defaults bind None; every module that binds groups imports this one, so this covers them all.
# See tests/classic/test_legacy_oss_sdp_pipe_script.py.
if dist.is_available():
    import torch.distributed.nn.functional  # noqa: F401

def set_group(axis: str, group: Any) -> None:
    """Bind ``axis`` to a process group (``None`` = size 1) in the process-wide table (what applies
    outside every module: classic FairScale modules' groups). A mesh binds its own table
    (``passes.ops.groups``)."""
    groups.PROCESS.bind(axis, group)


def clear_groups() -> None:
    groups.PROCESS.clear()


def get_group(axis: str) -> Any:
    """The group ``axis`` means here: the running module's, else the process-wide one, else None."""
    return groups.resolve(axis)


def group_size(axis: str) -> int:
    group = get_group(axis)
    return 1 if group is None else dist.get_world_size(group)


def group_rank(axis: str) -> int:
    group = get_group(axis)
    return 0 if group is None else dist.get_rank(group)


# ------------------------------------------------------------------------------------------------
# the byte counter


@dataclass
class CommCounter:
    """Bytes each collective kind moved on this rank, by the ring-algorithm volume.

    ``bytes[kind]`` is the per-rank wire volume, ``payload[kind]`` the tensor bytes handed to the
    collective, ``calls[kind]`` the number of calls. Keys are ``"<kind>:<axis>"``.
    """

    bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    payload: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, kind: str, axis: str, payload: int, wire: float) -> None:
        key = f"{kind}:{axis}"
        self.bytes[key] += wire
        self.payload[key] += payload
        self.calls[key] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.payload.clear()
        self.calls.clear()

    def total_bytes(self) -> float:
        return float(sum(self.bytes.values()))

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {
            k: {"bytes": self.bytes[k], "payload": self.payload[k], "calls": self.calls[k]}
            for k in sorted(self.bytes)
        }

    def summary(self) -> str:
        rows = [f"{'collective':<28}{'calls':>8}{'MiB moved':>14}"]
        for key, row in self.snapshot().items():
            rows.append(f"{key:<28}{int(row['calls']):>8}{row['bytes'] / 2**20:>14.3f}")
        rows.append(f"{'total':<28}{'':>8}{self.total_bytes() / 2**20:>14.3f}")
        return "\n".join(rows)


COUNTER = CommCounter()
"""The process-wide counter: every collective of the process records into it."""
groups.PROCESS.counter = COUNTER


def count(kind: str, axis: str, payload: int, wire: float) -> None:
    """Record one collective in :data:`COUNTER` and in the active mesh's own counter."""
    COUNTER.record(kind, axis, payload, wire)
    table = groups.current()
    if table is not groups.PROCESS:
        if table.counter is None:
            table.counter = CommCounter()
        table.counter.record(kind, axis, payload, wire)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def ring_bytes(kind: str, nbytes: int, n: int) -> float:
    """Per-rank wire bytes of one collective on ``n`` ranks over a tensor of ``nbytes``
    (``nbytes`` is the full, unsharded tensor for all-gather and reduce-scatter): the ring
    algorithms' volume, from the table the cost model reads too (``planner.collectives``)."""
    return wire_bytes(kind, nbytes, n)


# ------------------------------------------------------------------------------------------------
# plain collectives (no autograd), each recording into COUNTER and the flight record


def traced(op: str, axis: str, t: torch.Tensor, call: Any, *, async_op: bool = False) -> Any:
    """Post ``call()`` (a torch.distributed collective) to the flight record: waited for through
    it when synchronous, returned as a ``TracedWork`` when ``async_op``."""
    entry = RECORDER.post(op, axis, describe_tensor(t), nbytes=_nbytes(t), size=group_size(axis))
    if async_op:
        return TracedWork(call(), entry, RECORDER)
    return RECORDER.wait(entry, call)


def all_reduce_(t: torch.Tensor, axis: str, *, op: Any = None, async_op: bool = False) -> Any:
    """In-place sum (or ``op``) all-reduce over ``axis``. Returns a Work if ``async_op``."""
    n = group_size(axis)
    if n == 1:
        return None
    count("all_reduce", axis, _nbytes(t), ring_bytes("all_reduce", _nbytes(t), n))
    group = get_group(axis)
    return traced("all_reduce", axis, t, lambda: dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group,
                                                                 async_op=async_op), async_op=async_op)


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, axis: str, *, async_op: bool = False) -> Any:
    """Gather equal 1-D-contiguous shards into ``out`` (``out.numel() == n * shard.numel()``)."""
    n = group_size(axis)
    if n == 1:
        out.copy_(shard.reshape(out.shape))
        return None
    count("all_gather", axis, _nbytes(out), ring_bytes("all_gather", _nbytes(out), n))
    group = get_group(axis)
    return traced("all_gather", axis, out, lambda: dist.all_gather_single(out, shard, group=group, async_op=async_op),
                  async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, axis: str, *, async_op: bool = False) -> Any:
    """Sum ``full`` over ranks and keep this rank's contiguous 1/n of it in ``out``."""
    n = group_size(axis)
    if n == 1:
        out.copy_(full.reshape(out.shape))
        return None
    count("reduce_scatter", axis, _nbytes(full), ring_bytes("reduce_scatter", _nbytes(full), n))
    group = get_group(axis)
    return traced("reduce_scatter", axis, full,
                  lambda: dist.reduce_scatter_single(out, full, group=group, async_op=async_op), async_op=async_op)


def broadcast_(t: torch.Tensor, axis: str, *, src_rank: int = 0) -> None:
    """Broadcast from the axis-local rank ``src_rank``."""
    n = group_size(axis)
    if n == 1:
        return
    group = get_group(axis)
    count("broadcast", axis, _nbytes(t), ring_bytes("broadcast", _nbytes(t), n))
    src = dist.get_global_rank(group, src_rank)
    traced("broadcast", axis, t, lambda: dist.broadcast(t, src=src, group=group))


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, axis: str, *,
                      out_splits: Sequence[int] | None = None, in_splits: Sequence[int] | None = None) -> None:
    n = group_size(axis)
    if n == 1:
        out.copy_(inp)
        return
    count("all_to_all", axis, _nbytes(inp), ring_bytes("all_to_all", _nbytes(inp), n))
    group = get_group(axis)
    traced("all_to_all", axis, inp, lambda: dist.all_to_all_single(out, inp, output_split_sizes=out_splits,
                                                                    input_split_sizes=in_splits, group=group))


def all_gather_object(obj: Any, axis: str, *, what: str = "objects") -> list[Any]:
    """Every rank's ``obj`` over ``axis``, in axis rank order (pickled; for small metadata only)."""
    n = group_size(axis)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    group = get_group(axis)
    entry = RECORDER.post("all_gather_object", axis, what)
    RECORDER.wait(entry, lambda: dist.all_gather_object(out, obj, group=group))
    return out


# ------------------------------------------------------------------------------------------------
# autograd-paired collectives (what the passes insert)


def _gather_dim(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    n = group_size(axis)
    if n == 1:
        return x
    x = x.contiguous()
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, moved, axis)
    return out.movedim(0, dim).contiguous()


def _split_dim(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    n = group_size(axis)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {n} ranks of axis {axis!r}")
    return x.chunk(n, dim=dim)[group_rank(axis)].contiguous()


def _reduce_scatter_dim(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    n = group_size(axis)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {n} ranks of {axis!r}")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, moved, axis)
    return out.movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    if group_size(axis) == 1:
        return x
    out = x.contiguous().clone()
    all_reduce_(out, axis)
    return out


@groups.group_function
class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: str) -> torch.Tensor:
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.axis), None


@groups.group_function
class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: str) -> torch.Tensor:
        return _all_reduce(x, axis)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@groups.group_function
class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
        ctx.axis, ctx.dim = axis, dim
        return _gather_dim(x, axis, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split_dim(grad, ctx.axis, ctx.dim), None, None


@groups.group_function
class _ScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
        ctx.axis, ctx.dim = axis, dim
        return _split_dim(x, axis, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_dim(grad, ctx.axis, ctx.dim), None, None


@groups.group_function
class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
        ctx.axis, ctx.dim = axis, dim
        return _gather_dim(x, axis, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter_dim(grad, ctx.axis, ctx.dim), None, None


@groups.group_function
class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
        ctx.axis, ctx.dim = axis, dim
        return _reduce_scatter_dim(x, axis, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_dim(grad, ctx.axis, ctx.dim), None, None


def copy_to_group(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity in forward, all-reduce of the gradient in backward."""
    return _CopyToGroup.apply(x, axis)


def reduce_from_group(x: torch.Tensor, axis: str) -> torch.Tensor:
    """All-reduce (sum) in forward, identity in backward."""
    return _ReduceFromGroup.apply(x, axis)


def gather_from_group(x: torch.Tensor, axis: str, dim: int = -1) -> torch.Tensor:
    """All-gather along ``dim`` in forward; keep this rank's chunk of the gradient in backward."""
    return _GatherFromGroup.apply(x, axis, dim)


def scatter_to_group(x: torch.Tensor, axis: str, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk along ``dim`` in forward; all-gather the gradient in backward."""
    return _ScatterToGroup.apply(x, axis, dim)


def gather_seq(x: torch.Tensor, axis: str, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel entry: all-gather along ``dim`` forward, reduce-scatter backward."""
    return _GatherSeq.apply(x, axis, dim)


def reduce_scatter_seq(x: torch.Tensor, axis: str, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel exit: reduce-scatter along ``dim`` forward, all-gather backward."""
    return _ReduceScatterSeq.apply(x, axis, dim)
