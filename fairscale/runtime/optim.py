"""Optimizers for data-parallel rank graphs: any ``torch.optim`` optimizer over the local shards.

Usage::

    opt = DataParallelOptimizer(rank_gm, torch.optim.AdamW, lr=1e-3)
    loss = rank_gm(*batch); loss.backward()
    opt.clip_grad_norm_(1.0)          # global norm across every shard
    opt.step(); opt.zero_grad(set_to_none=True)

What the wrapped optimizer sees, per kind:

* ddp: the replicated parameters (it is the user's optimizer, unchanged);
* zero1/zero2: one fp32 master shard per gradient bucket (1/n of the bucket, ZeRO "P_os"); after
  ``step`` the updated shards are all-gathered into the replicated parameters;
* fsdp: one fp32 flat shard per unit (1/n of the unit); no communication at step time.

Elementwise optimizers (SGD, Adam, AdamW, Adagrad, RMSprop ...) give exactly the single-process
update on any shard. Optimizers that look across a whole tensor (LAMB/LARS trust ratios, Adafactor's
factored moments, Shampoo) would see flat shards instead and are refused for sharded kinds.

``zero_grad(set_to_none=True)`` is safe: every gradient reaches ``.grad`` the way autograd puts it
there, assigned when ``.grad`` is None and added otherwise: through autograd itself, or for
DDP/ZeRO buckets through the end-of-backward callback that waits for their asynchronous
reductions (``passes.ops.dp_ops``). FairScale 0.4's ShardedDataParallel wrote into cached gradient
buffers and silently lost gradients after ``set_to_none``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable

import torch
import torch.distributed as dist
import torch.fx

from passes.ops import comm
from planner.modpath import fetch_attr
from passes.dp.info import DataParallelInfo, dp_info
from passes.layout import find_layout
from fairscale.runtime.optim_groups import OptimizerGroups, Segments, group_runs

__all__ = ["DataParallelOptimizer", "ELEMENTWISE", "GradPiece", "merge_grad_norm_parts", "reduce_grad_norm",
           "clip_coefficient"]

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "ASGD", "Rprop")
"""torch.optim classes whose update of an element depends only on that element's history."""


class DataParallelOptimizer:
    """Wrap ``optimizer_cls`` (any torch.optim optimizer) around the tensors this rank updates."""

    def __init__(self, gm: torch.fx.GraphModule, optimizer_cls: Callable[..., torch.optim.Optimizer],
                 groups: OptimizerGroups | None = None, **kwargs: Any) -> None:
        self.gm = gm
        self.info = dp_info(gm)
        kind = self.info.kind
        if kind != "ddp" and getattr(optimizer_cls, "__name__", "") not in ELEMENTWISE \
                and not kwargs.pop("allow_non_elementwise", False):
            raise ValueError(
                f"{getattr(optimizer_cls, '__name__', optimizer_cls)} may not be elementwise; kind={kind!r} shards "
                f"flattened parameters, so it would see shards instead of whole tensors. Use one of {ELEMENTWISE}, "
                "use kind='ddp', or pass allow_non_elementwise=True if its update is elementwise")
        self.params = self._params()
        self._pieces: list[GradPiece] | None = None
        self._segments: Segments | None = None
        if groups is not None:
            self.optimizer = self._grouped(groups)
        else:
            # a pipeline stage may hold no trainable parameter (Whisper's interleaved stage of a
            # parameterless layer); torch.optim refuses an empty list, but takes one empty group
            self.optimizer = optimizer_cls(self.params or [{"params": []}], **kwargs)

    def _grouped(self, spec: OptimizerGroups) -> torch.optim.Optimizer:
        """The user's groups over this stage's tensors, a flat tensor spanning groups as segments
        (``fairscale.runtime.optim_groups``)."""
        def group_of(key: str) -> int:
            if key not in spec.group_of:
                raise ValueError(f"{key} is trained on this rank but is in none of the optimizer's groups")
            return spec.group_of[key]

        pieces: dict[int, list[tuple[str, int, int]]] = {}
        for piece in self.grad_pieces():
            pieces.setdefault(id(piece.param), []).append((piece.key, piece.start, piece.stop))
        groups: list[list[torch.Tensor]] = [[] for _ in spec.options]
        split: dict[torch.Tensor, list[tuple[torch.Tensor, int, int]]] = {}
        for p in self.params:
            runs = group_runs(p, pieces.get(id(p), []), group_of)
            if len(runs) <= 1:  # none: a shard of padding only, whose zeros any group keeps zero
                groups[runs[0][2] if runs else 0].append(p)
                continue
            flat = p.detach().view(-1)
            split[p] = [(flat[a:b], a, b) for a, b, _ in runs]
            for (view, _, _), (_, _, g) in zip(split[p], runs):
                groups[g].append(view)
        optimizer = spec.build(groups)
        if split:
            self._segments = Segments(optimizer, split)
        return optimizer

    def _params(self) -> list[torch.nn.Parameter]:
        if self.info.kind == "ddp":
            return [p for p in self.gm.parameters() if p.requires_grad]
        return self.info.sharded_params() + self.info.plain_params()

    # -- the torch.optim surface ------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The optimizer's state by the tensors in ``params`` (segments seen whole)."""
        return self._segments if self._segments is not None else self.optimizer.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        place = self.info.placement
        if place.store != place.compute and place.compute.type == "cuda":
            # offloaded: the host steps shards that asynchronous copies to the GPU may still be reading
            torch.cuda.current_stream(place.compute).synchronize()
        if self._segments is not None:
            self._segments.refresh_grads()
        out = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        for bucket in self.info.buckets:
            if bucket.shard is not None:
                bucket.gather_params()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        # zero1 also holds full averaged grads on the replicas; a segmented tensor's own gradient
        # is not the optimizer's (its segments hold views of it)
        for p in [*self.gm.parameters(), *self.params]:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (over its local tensors); see ``fairscale.runtime.state``
        for the state in the user's parameter keys."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    # -- clipping ---------------------------------------------------------------------------------

    def grad_pieces(self) -> list[GradPiece]:
        """Every element this optimizer steps, as pieces of user tensors (see :class:`GradPiece`).
        Computed once: the pieces depend only on the compiled layout."""
        if self._pieces is None:
            self._pieces = _grad_pieces(self.gm, self.info, self.params)
        return self._pieces

    @torch.no_grad()
    def grad_norm_parts(self, norm_type: float = 2.0, *, skip_keys: Collection[str] = ()) -> dict[tuple[str, ...], torch.Tensor]:
        """This rank's partial gradient norms, keyed by the axes their pieces are split over.

        Each value is the sum of ``|g|**norm_type`` (the max of ``|g|`` for ``inf``) over the
        pieces whose user tensor is partitioned over exactly those axes: ``()`` for whole tensors,
        ``("tp",)`` for tensor-parallel slices, ``("dp",)`` for data-parallel shards of whole
        tensors, ``("dp", "tp")`` for shards of slices, and so on for any axis a ``TensorShard``
        names (``"ep"``). Values are float64 scalars. Pieces of ``skip_keys`` (user keys) are left
        out, e.g. the second copy of a weight tied across pipeline stages.
        """
        layout = find_layout(self.gm)
        tp = layout.tp if layout is not None else {}
        inf = math.isinf(norm_type)
        device = _device()  # the parts meet in collectives; gradients may live elsewhere (offload)
        parts: dict[tuple[str, ...], torch.Tensor] = {}
        for piece in self.grad_pieces():
            if piece.key in skip_keys:
                continue
            axes = set(piece.axes)
            spec = tp.get(piece.key)
            if spec is not None and spec.count > 1:
                if comm.group_size(spec.axis) != spec.count:  # else its slices would never be added up
                    raise ValueError(
                        f"{piece.key} is sliced {spec.count} ways on axis {spec.axis!r}, but that axis is bound to "
                        f"{comm.group_size(spec.axis)} rank(s); bind it with passes.ops.comm.set_group({spec.axis!r}, "
                        "group) (fairscale.runtime.mesh.build_mesh does for the plan's axes) before clipping")
                axes.add(spec.axis)
            key = tuple(sorted(axes))
            acc = parts.setdefault(key, torch.zeros((), dtype=torch.float64, device=device))
            g = piece.param.grad
            if g is None or piece.stop <= piece.start:
                continue  # no gradient (unused this step) adds nothing, but the key stays for the collectives
            g = g.detach().reshape(-1)[piece.start:piece.stop]
            dtype = torch.promote_types(g.dtype, torch.float32)
            if inf:
                parts[key] = torch.maximum(acc, g.abs().max().to(device, torch.float64))
            else:
                norm = torch.linalg.vector_norm(g, norm_type, dtype=dtype).to(device, torch.float64)
                parts[key] = acc + norm ** norm_type
        return parts

    @torch.no_grad()
    def scale_grads_(self, coef: torch.Tensor) -> None:
        """Multiply every gradient this optimizer steps by ``coef`` (and, for zero1, the replicas'
        full gradients too, so they stay consistent with the shards)."""
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
        if self.info.kind == "zero1":
            stepped = {id(p) for p in self.params}
            for p in self.gm.parameters():
                if p.grad is not None and p.requires_grad and id(p) not in stepped:
                    p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, reduce_axes: Iterable[str] = ()) -> torch.Tensor:
        """Scale gradients so their global ``norm_type`` norm is at most ``max_norm``; return the
        norm before clipping (``torch.nn.utils.clip_grad_norm_`` semantics, same 1e-6 epsilon).

        Shards and slices add their partial norms over their own axes (padding is zero and adds
        nothing); whole tensors are replicas and count once. ``reduce_axes`` names further axes
        whose ranks hold disjoint parameters (``pp``).
        """
        total = reduce_grad_norm(self.grad_norm_parts(norm_type), norm_type, reduce_axes=reduce_axes)
        self.scale_grads_(clip_coefficient(total, max_norm))
        return total.to(_grad_dtype(self.params))


@dataclass(frozen=True)
class GradPiece:
    """Elements ``[start, stop)`` of ``param``'s flattened gradient belong to user tensor ``key``;
    ``axes`` are the data-parallel axes ``param`` is a shard on (tensor-parallel slicing is read
    from the layout by key)."""

    param: torch.nn.Parameter
    key: str
    start: int
    stop: int
    axes: tuple[str, ...] = ()


def _grad_pieces(gm: torch.fx.GraphModule, info: DataParallelInfo, params: list[torch.nn.Parameter]) -> list[GradPiece]:
    pieces: list[GradPiece] = []

    def flat(param: torch.nn.Parameter, keys: list[str], shapes: list[torch.Size], offset: int, axis: str) -> None:
        # the shard holds [offset, offset + numel) of the padded flat concatenation of ``keys``
        start = 0
        for key, shape in zip(keys, shapes):
            lo, hi = max(start, offset), min(start + shape.numel(), offset + param.numel())
            pieces.append(GradPiece(param, key, lo - offset, max(hi, lo) - offset, (axis,)))
            start += shape.numel()

    for b in info.buckets:
        if b.shard is not None:
            flat(b.shard, b.keys, b.shapes, b.shard_range[0], b.axis)
        elif b.kind == "ddp":
            pieces += [GradPiece(p, k, 0, p.numel()) for p, k in zip(b.params, b.keys)]
    for u in info.units:
        flat(u.flat, u.keys, u.shapes, u.rank * u.flat.numel(), u.axis)
    covered = {id(piece.param) for piece in pieces}
    layout = find_layout(gm)
    by_id = {}
    for attr, key in (layout.keys.items() if layout is not None else []):
        try:
            by_id[id(fetch_attr(gm, attr))] = key
        except AttributeError:
            continue
    for p in params:
        if id(p) in covered:
            continue
        if id(p) not in by_id:
            raise ValueError(f"a trainable tensor of shape {tuple(p.shape)} has no user key in the layout "
                             "(gm.meta['fs_layout']), so its share of the gradient norm is unknown; compile the "
                             "graph with passes.compile_rank or shard_data_parallel_pass")
        pieces.append(GradPiece(p, by_id[id(p)], 0, p.numel()))
    return pieces


def merge_grad_norm_parts(parts: Iterable[dict[tuple[str, ...], torch.Tensor]], norm_type: float = 2.0,
                          ) -> dict[tuple[str, ...], torch.Tensor]:
    """Combine partial norms of several local graphs (a rank's pipeline stages)."""
    out: dict[tuple[str, ...], torch.Tensor] = {}
    for part in parts:
        for key, value in part.items():
            if key not in out:
                out[key] = value
            else:
                out[key] = torch.maximum(out[key], value) if math.isinf(norm_type) else out[key] + value
    return out


@torch.no_grad()
def reduce_grad_norm(parts: dict[tuple[str, ...], torch.Tensor], norm_type: float = 2.0, *,
                     reduce_axes: Iterable[str] = ()) -> torch.Tensor:
    """The global norm from partial norms (:meth:`DataParallelOptimizer.grad_norm_parts`). Collective.

    Each part is reduced over its own axes (one all-reduce per axis, over the parts that name it),
    after which it is the same on every rank holding that part; the parts are then added (or
    maxed), and the total reduced over ``reduce_axes``, whose ranks hold disjoint tensors (``pp``).
    Every rank of an axis's group must hold the same keys that name it (ranks of one pipeline
    stage do: the keys follow the stage's layout, not which elements a shard happens to cover).
    Returns a float64 scalar, the same on every rank.
    """
    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    parts = dict(parts)
    for axis in sorted({a for key in parts for a in key}):
        if comm.group_size(axis) <= 1:
            continue
        keys = sorted(k for k in parts if axis in k)
        vec = torch.stack([parts[k] for k in keys])
        group = comm.get_group(axis)
        comm.traced("all_reduce", axis, vec, lambda: dist.all_reduce(vec, op=op, group=group))  # not model traffic
        parts.update(zip(keys, vec.unbind()))
    values = list(parts.values()) or [torch.zeros((), dtype=torch.float64, device=_device())]
    total = torch.stack(values).max() if inf else torch.stack(values).sum()
    total = total.reshape(1).clone()
    for axis in reduce_axes:
        if comm.group_size(axis) > 1:
            group = comm.get_group(axis)
            comm.traced("all_reduce", axis, total, lambda: dist.all_reduce(total, op=op, group=group))
    return total[0] if inf else total[0] ** (1.0 / norm_type)


def _device() -> torch.device:
    """Where collectives of this process group take their tensors (nccl: the current GPU)."""
    from fairscale.runtime.device import collective_device

    return collective_device()


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def _grad_dtype(params: list[torch.nn.Parameter]) -> torch.dtype:
    grads = [p.grad for p in params if p.grad is not None]
    return torch.promote_types(grads[0].dtype, torch.float32) if grads else torch.float32
