"""What crosses a pipeline rank's boundaries: microbatches in, activations and gradients out to and
in from the ranks of the neighbouring stages.

:class:`fairscale.runtime.pipeline.PipelineExecutor` runs the action loop; this module holds the
pieces it uses at the edges of each stage:

- :class:`StageLinks`: the tagged ``isend``/``irecv`` of ``SF``/``SB``/``RF``/``RB`` actions on the
  pp axis (bytes counted in ``comm.COUNTER``), with receive buffers sized by the boundary specs, and
  the first-step handshake in which neighbours compare the shapes and dtypes they will send and
  expect, so ranks that split different captures fail with the same error instead of hanging;
- :func:`split_microbatches`: cuts a batch along dim 0 and checks the pieces against the capture;
- :func:`local_specs` and :func:`check_values`: a stage's boundary at its rank-local shapes
  (sequence-parallel stages send shards, ``passes.tp.summary``) and the check of a stage's outputs
  against it before anything is sent;
- :class:`StepState`: one step's activations, gradients and pending messages, by microbatch and stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fairscale.runtime import p2p
from passes.ops import comm
from passes.tp.summary import tp_summary
from passes.program import StagedProgram, ValueSpec
from planner.schedule import PipelineSchedule

__all__ = ["PipelineError", "StageLinks", "StepState", "split_microbatches", "local_specs", "check_values"]


class PipelineError(RuntimeError):
    """A pipeline that cannot run as set up: wrong microbatch shapes, or stages that disagree."""


@dataclass
class StepState:
    """One step's values on this rank, keyed by (microbatch, stage) (receives: (kind, mb, stage))."""

    inputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict)
    recvs: dict[tuple[str, int, int], list[tuple[Any, torch.Tensor]]] = field(default_factory=dict)
    grads_out: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    local_grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    sends: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)


class StageLinks:
    """This rank's messages to the ranks of its stages' neighbours on the ``axis`` group.

    ``in_specs``/``out_specs`` map each local stage to the (rank-local) specs it receives and
    sends; they size the receive buffers and are what the handshake compares.
    """

    def __init__(self, schedule: PipelineSchedule, *, axis: str, rank: int, stages: int,
                 local_stages: Sequence[int], in_specs: Mapping[int, list[ValueSpec]],
                 out_specs: Mapping[int, list[ValueSpec]], device: torch.device = torch.device("cpu")) -> None:
        self.schedule = schedule
        self.axis = axis
        self.rank = rank
        self.stages = stages
        self.local_stages = local_stages
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.device = device
        """Where receive buffers and handshake messages are allocated (NCCL: this rank's GPU)."""

    def send_forward(self, mb: int, stage: int, outputs: Sequence[torch.Tensor]) -> list[tuple[Any, torch.Tensor]]:
        """Post the sends of ``stage``'s outputs of microbatch ``mb`` to the next stage's rank."""
        peer = self.peer(stage + 1)
        return [self._isend(t.detach().contiguous(), peer, p2p.tag("F", mb, stage + 1, i))
                for i, t in enumerate(outputs)]

    def send_backward(self, mb: int, stage: int, grads: Sequence[torch.Tensor]) -> list[tuple[Any, torch.Tensor]]:
        """Post the sends of ``stage``'s input gradients of microbatch ``mb`` to the previous stage's rank."""
        peer = self.peer(stage - 1)
        return [self._isend(g.contiguous(), peer, p2p.tag("B", mb, stage - 1, i)) for i, g in enumerate(grads)]

    def recv_forward(self, mb: int, stage: int) -> list[tuple[Any, torch.Tensor]]:
        """Post the receives of ``stage``'s inputs of microbatch ``mb`` from the previous stage's rank."""
        return self._irecv_all(self.in_specs[stage], self.peer(stage - 1), "F", mb, stage)

    def recv_backward(self, mb: int, stage: int) -> list[tuple[Any, torch.Tensor]]:
        """Post the receives of the gradients of ``stage``'s differentiable outputs from the next stage's rank."""
        specs = [s for s in self.out_specs[stage] if s.grad]
        return self._irecv_all(specs, self.peer(stage + 1), "B", mb, stage)

    def peer(self, stage: int) -> int:
        """The global rank that runs ``stage``."""
        return dist.get_global_rank(comm.get_group(self.axis), self.schedule.stage_rank(stage))

    def _isend(self, t: torch.Tensor, peer: int, tag: int) -> tuple[Any, torch.Tensor]:
        nbytes = t.numel() * t.element_size()
        comm.COUNTER.record("send", self.axis, nbytes, float(nbytes))
        return p2p.send(t, peer, group=comm.get_group(self.axis), tag=tag), t

    def _irecv_all(self, specs: Sequence[ValueSpec], peer: int, kind: str, mb: int,
                   stage: int) -> list[tuple[Any, torch.Tensor]]:
        out = []
        for i, spec in enumerate(specs):
            buf = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
            nbytes = buf.numel() * buf.element_size()
            comm.COUNTER.record("recv", self.axis, nbytes, float(nbytes))
            out.append((p2p.recv(buf, peer, group=comm.get_group(self.axis), tag=p2p.tag(kind, mb, stage, i)), buf))
        return out

    def handshake(self) -> None:
        """Exchange boundary specs with both neighbours; both sides raise on a mismatch."""
        n = self.stages
        mine: list[tuple[int, int, str, list[ValueSpec]]] = []  # (peer stage, boundary, role, my specs)
        for s in self.local_stages:
            if s + 1 < n and self.schedule.stage_rank(s + 1) != self.rank:
                mine.append((s + 1, s, "sends", self.out_specs[s]))
            if s > 0 and self.schedule.stage_rank(s - 1) != self.rank:
                mine.append((s - 1, s - 1, "expects", self.in_specs[s]))
        if not mine:
            return
        sends, recvs = [], []
        for peer_stage, boundary, role, specs in mine:
            code = torch.tensor(p2p.encode_specs(specs), dtype=torch.int64, device=self.device)
            size = torch.tensor([code.numel()], dtype=torch.int64, device=self.device)
            tag = p2p.tag("SHAKE", 0, boundary, 0 if role == "sends" else 1)
            peer = self.peer(peer_stage)
            group = comm.get_group(self.axis)
            sends += [p2p.send(size, peer, group=group, tag=tag), p2p.send(code, peer, group=group, tag=tag + 2)]
            other = torch.zeros(1, dtype=torch.int64, device=self.device)
            other_tag = p2p.tag("SHAKE", 0, boundary, 1 if role == "sends" else 0)
            recvs.append((p2p.recv(other, peer, group=group, tag=other_tag), other, peer, other_tag, boundary,
                          role, specs))
        problems = []
        for work, size, peer, other_tag, boundary, role, specs in recvs:
            work.wait()
            code = torch.zeros(int(size.item()), dtype=torch.int64, device=self.device)
            p2p.recv(code, peer, group=comm.get_group(self.axis), tag=other_tag + 2).wait()
            theirs = p2p.decode_specs(code.tolist())
            ours = [(tuple(s.shape), s.dtype) for s in specs]
            if theirs != ours:
                sent, expected = (ours, theirs) if role == "sends" else (theirs, ours)
                problems.append(f"stage {boundary} sends {p2p.format_specs(sent)} but stage {boundary + 1} expects "
                                f"{p2p.format_specs(expected)}")
        for w in sends:
            w.wait()
        if problems:
            raise PipelineError("pipeline shape handshake failed: " + "; ".join(problems) + ". Every pipeline rank "
                                "must split the same capture (same model, microbatch size and plan).")


def split_microbatches(batch: Sequence[Any], m: int, program: StagedProgram,
                       local_stages: Sequence[int]) -> list[tuple[Any, ...]]:
    """``batch`` cut into ``m`` microbatches along dim 0 (non-tensors repeated in each), checked
    against the shapes ``local_stages`` were captured for."""
    parts: list[list[Any]] = [[] for _ in range(m)]
    for i, x in enumerate(batch):
        if not isinstance(x, torch.Tensor):
            for p in parts:
                p.append(x)
            continue
        if x.shape[0] % m:
            raise PipelineError(f"batch input {i} has {x.shape[0]} rows, which do not split into {m} "
                                "microbatches; use a batch size divisible by the microbatch count")
        for p, chunk in zip(parts, x.chunk(m)):
            p.append(chunk)
    for s in local_stages:
        stage = program.stages[s]
        for idx, spec in zip(stage.batch_inputs, stage.batch_specs):
            got = parts[0][idx]
            if isinstance(got, torch.Tensor) and tuple(got.shape) != spec.shape:
                raise PipelineError(f"microbatch input {idx} has shape {list(got.shape)} but stage {s} was captured "
                                    f"for {list(spec.shape)}: {_shape_fix(tuple(got.shape), spec.shape)}")
    return [tuple(p) for p in parts]


def _shape_fix(got: tuple[int, ...], want: tuple[int, ...]) -> str:
    """What differs between a microbatch's shape and the captured one, and what to do: only the
    batch dim (rows) follows the plan; every other dim was fixed by the example batch."""
    if len(got) != len(want):
        return (f"{len(got)} dims instead of {len(want)}; give every batch the example batch's shapes, or parallelize "
                "again with example_inputs shaped like the batches you train with")
    other = [d for d in range(1, len(want)) if got[d] != want[d]]
    if other:
        d = other[0]
        return (f"dim {d} is {got[d]}, not {want[d]} (a length fixed when parallelize captured the model, such as "
                f"the sequence length); give every batch the example batch's shape beyond dim 0 (pad or cut dim {d} "
                f"to {want[d]}), or parallelize again with example_inputs shaped like the batches you train with")
    return (f"{got[0]} rows per microbatch instead of {want[0]} (global batch / (dp × microbatches)); train with the "
            "global batch the plan was made for, or parallelize again with global_batch= (or example_inputs) of the "
            "batch you train with")


def check_values(values: Sequence[Any], specs: Sequence[ValueSpec], what: str) -> None:
    """Raise unless ``values`` are tensors of exactly the shapes and dtypes of ``specs``."""
    if len(values) != len(specs):
        raise PipelineError(f"{what}: {len(values)} values, expected {len(specs)} ({_fmt_specs(specs)})")
    for v, spec in zip(values, specs):
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != spec.shape or v.dtype != spec.dtype:
            got = f"{list(v.shape)}:{v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise PipelineError(f"{what} {spec.name} is {got} but the boundary expects {spec.describe()}")


def local_specs(module: nn.Module, specs: Sequence[ValueSpec], key: str) -> list[ValueSpec]:
    """``specs`` with the rank-local shapes a tensor-parallel stage records in
    (``passes.tp.summary``); unchanged without one."""
    records = (tp_summary(module) or {}).get(key)
    if not records:
        return list(specs)
    if len(records) != len(specs):
        raise PipelineError(f"the tensor-parallel stage graph records {len(records)} {key} values but the stage "
                            f"boundary has {len(specs)} ({_fmt_specs(specs)}); rewrite the stage graph of this split")
    return [spec if place == "-" else dataclasses.replace(spec, shape=tuple(shape))
            for spec, (place, shape) in zip(specs, records)]


def _fmt_specs(specs: Sequence[ValueSpec]) -> str:
    return ", ".join(s.describe() for s in specs)
