"""What crosses a pipeline rank's boundaries: microbatches in, activations and gradients out to and
in from the ranks of the neighbouring stages.

:class:`fairscale.runtime.pipeline.PipelineExecutor` runs the action loop; this module holds the
pieces it uses at the edges of each stage:

- :class:`StageLinks`: the :class:`fairscale.runtime.p2p.Message` s of the ``SF``/``SB``/``RF``/``RB``
  actions on the pp axis (the executor posts each batch of them in one ``batch_isend_irecv``),
  with receive buffers sized by the boundary specs, and the first-step handshake in which the
  pipeline ranks compare the shapes and dtypes every stage will send and expect, so ranks that
  split different captures fail with the same error instead of hanging;
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

from fairscale.runtime.p2p import Batch, Message, format_specs
from passes.ops import comm
from passes.program import StagedProgram, ValueSpec
from passes.tp.summary import tp_summary
from planner.schedule import PipelineSchedule

__all__ = ["PipelineError", "StageLinks", "StepState", "split_microbatches", "local_specs", "check_values"]


class PipelineError(RuntimeError):
    """A pipeline that cannot run as set up: wrong microbatch shapes, or stages that disagree."""


@dataclass
class StepState:
    """One step's values on this rank, keyed by (microbatch, stage) (receives: (kind, mb, stage))."""

    inputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict)
    recvs: dict[tuple[str, int, int], tuple[Batch, list[torch.Tensor]]] = field(default_factory=dict)
    grads_out: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    local_grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    sends: list[Batch] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    loss_microbatches: list[int] = field(default_factory=list)
    """The microbatch of each entry of ``losses``."""


class StageLinks:
    """This rank's messages to the ranks of its stages' neighbours on the ``axis`` group.

    ``in_specs``/``out_specs`` map each local stage to the (rank-local) specs it receives and
    sends; they size the receive buffers and are what the handshake compares. A message is named
    alike on both sides (``F3 0→1 #0``: activation value 0 of microbatch 3 from stage 0 to 1;
    ``B3 1→0 #0``: a gradient), which is what the NCCL semantics checker matches.
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
        """Where receive buffers are allocated (NCCL: this rank's GPU)."""

    def send_forward(self, mb: int, stage: int, outputs: Sequence[torch.Tensor]) -> list[Message]:
        """The sends of ``stage``'s outputs of microbatch ``mb`` to the next stage's rank."""
        peer, action = self.peer(stage + 1), f"SF{mb}@{stage}"
        return [Message(True, peer, t.detach().contiguous(), f"F{mb} {stage}→{stage + 1} #{i}", action)
                for i, t in enumerate(outputs)]

    def send_backward(self, mb: int, stage: int, grads: Sequence[torch.Tensor]) -> list[Message]:
        """The sends of ``stage``'s input gradients of microbatch ``mb`` to the previous stage's rank."""
        peer, action = self.peer(stage - 1), f"SB{mb}@{stage}"
        return [Message(True, peer, g.contiguous(), f"B{mb} {stage}→{stage - 1} #{i}", action)
                for i, g in enumerate(grads)]

    def recv_forward(self, mb: int, stage: int) -> list[Message]:
        """The receives of ``stage``'s inputs of microbatch ``mb`` from the previous stage's rank."""
        return self._recvs(self.in_specs[stage], stage - 1, stage, f"F{mb}", f"RF{mb}@{stage}")

    def recv_backward(self, mb: int, stage: int) -> list[Message]:
        """The receives of the gradients of ``stage``'s differentiable outputs from the next stage's rank."""
        specs = [s for s in self.out_specs[stage] if s.grad]
        return self._recvs(specs, stage + 1, stage, f"B{mb}", f"RB{mb}@{stage}")

    def peer(self, stage: int) -> int:
        """The global rank that runs ``stage``."""
        return dist.get_global_rank(comm.get_group(self.axis), self.schedule.stage_rank(stage))

    def _recvs(self, specs: Sequence[ValueSpec], src: int, dst: int, what: str, action: str) -> list[Message]:
        peer = self.peer(src)
        return [Message(False, peer, torch.empty(spec.shape, dtype=spec.dtype, device=self.device),
                        f"{what} {src}→{dst} #{i}", action) for i, spec in enumerate(specs)]

    def handshake(self) -> None:
        """Every pipeline rank shares the boundary specs of its stages (one all-gather of small
        objects over the pp axis), and every rank checks every boundary between two ranks: all
        raise the same error on a mismatch, before any activation is sent. Being the first
        collective on the pp group, it also lets NCCL's batched point-to-point that follows involve
        only some ranks of the group (``batch_isend_irecv`` needs every rank in the group's first call)."""
        mine = {s: ([(tuple(x.shape), x.dtype) for x in self.in_specs[s]],
                    [(tuple(x.shape), x.dtype) for x in self.out_specs[s]]) for s in self.local_stages}
        every: dict[int, Any] = {}
        for part in comm.all_gather_object(mine, self.axis, what="pipeline boundary specs"):
            every.update(part)
        problems = []
        for s in range(self.stages - 1):
            if self.schedule.stage_rank(s) == self.schedule.stage_rank(s + 1) or s not in every or s + 1 not in every:
                continue
            sent, expected = every[s][1], every[s + 1][0]
            if sent != expected:
                problems.append(f"stage {s} sends {format_specs(sent)} but stage {s + 1} expects {format_specs(expected)}")
        if problems:
            raise PipelineError("pipeline shape handshake failed: " + "; ".join(problems) + ". Every pipeline rank "
                                "must split the same capture (same model, microbatch size and plan).")


def split_microbatches(batch: Sequence[Any], m: int, program: StagedProgram,
                       local_stages: Sequence[int]) -> list[tuple[Any, ...]]:
    """``batch`` cut into ``m`` microbatches along dim 0 (non-tensors and 0-dim tensors repeated in
    each, as ``data_parallel.local_slice`` gives them to every dp rank), checked against the shapes
    ``local_stages`` were captured for."""
    parts: list[list[Any]] = [[] for _ in range(m)]
    for i, x in enumerate(batch):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
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
