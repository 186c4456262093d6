"""Run one pipeline rank's schedule: its stages' forwards and backwards, with P2P on the pp axis.

Usage (every rank of the pp × dp × tp mesh)::

    program = split_stages_pass(graph.gm, plan, graph=graph)          # same on every rank
    schedule = build_schedule("1f1b", pp=2, microbatches=4)
    pipe = PipelineExecutor(program, schedule)                          # binds to comm's "pp" axis
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    for batch in data:                                                   # this dp rank's batch
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(batch)       # every pp rank gets the loss, mean over microbatches
        opt.step()

``step`` cuts the batch into ``schedule.microbatches`` microbatches along dim 0 and runs this
rank's batched program (``planner.schedule_batched``): ``F``/``B`` call the stage GraphModule and
``torch.autograd.backward`` on its outputs; a batch ``[SF3 RB1]`` posts, in one
``batch_isend_irecv`` without tags (``fairscale.runtime.p2p``), the sends of stage outputs or
input gradients and the receives that later computes wait on. Every pair of ranks posts its
messages in the same batches and order, which is what NCCL needs (messages matched per pair in
order, sends that wait for the peer's receive); the program is checked against that model when
the executor is built. Each microbatch's loss is scaled by ``1 / microbatches``, so the
accumulated gradients are those of the mean loss over the step's batch. After the last action,
copies of parameters held by several stages (tied embeddings) get the sum of all copies'
gradients, added in stage order on every holder so the copies stay bitwise identical; then the
last stage's rank broadcasts the step loss over the pp axis.

Every compute and batch first names itself in the flight record's context (``step 3, F1@0``),
so a collective that times out says where (``fairscale.runtime.watchdog``). With
``nccl_check=True`` (or ``FAIRSCALE_NCCL_CHECK=1``), every batch also goes through the NCCL
semantics checker (``fairscale.runtime.nccl_check``) and each step's batches of all pipeline
ranks are checked together at its end.

Every rank loads the same microbatches (stages read the batch inputs they need, e.g. labels on the
last stage), so data never travels down the pipeline.

Safety: on the first step, neighbouring ranks exchange the shapes and dtypes they will send and
expect; a mismatch (ranks that split different captures) raises the same clear error on both
sides before any activation is sent. Every step checks the microbatch shapes against the capture
and each stage's outputs against the boundary before sending, so a wrong batch is an error on
every rank, never a hang.

Tensor parallel: a stage graph rewritten with sequence parallelism sends and receives its
activations as sequence shards; their rank-local shapes (``passes.tp.summary``) size the p2p
buffers, the checks and the handshake.

Data parallel: the stage graphs may be rewritten by ``shard_data_parallel_pass`` (after this
split); each stage's backwards except its last of the step run under ``passes.ops.dp_ops.no_sync`` so
gradients are reduced over dp once per step.

This module holds the executor and its action loop. What crosses stage boundaries (sends
and receives, the shape handshake, microbatch splitting and the boundary checks) is in
:mod:`fairscale.runtime.pipeline_io`; the checks and gradient sums of tied parameters are in
:mod:`fairscale.runtime.pipeline_tied`. ``PipelineError`` is defined in ``pipeline_io`` and
re-exported here.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence

import torch
from torch import nn

from fairscale.runtime import nccl_check as nccl
from fairscale.runtime import p2p
from fairscale.runtime.pipeline_io import (PipelineError, StageLinks, StepState, check_values, local_specs,
                                           split_microbatches)
from fairscale.runtime.pipeline_tied import TiedParams, fetch_attr, stage_layout
from passes.ops import comm
from passes.ops.flight import RECORDER
from passes.program import StagedProgram
from planner.schedule import Action, CommBatch, PipelineSchedule, check_nccl_order, simulate

__all__ = ["PipelineExecutor", "PipelineError", "StepTrace"]


@dataclass
class StepTrace:
    """Wall-clock record of one step on this rank (``record=True``): for Gantt charts and bubbles."""

    start: float = 0.0
    end: float = 0.0
    compute: list[tuple[str, float, float]] = field(default_factory=list)
    """(action token, start, end) of every F and B, perf_counter seconds."""

    @property
    def busy(self) -> float:
        return sum(e - s for _, s, e in self.compute)

    @property
    def bubble(self) -> float:
        """Fraction of the step this rank spent outside F and B (waiting or communicating)."""
        span = self.end - self.start
        return 1.0 - self.busy / span if span > 0 else 0.0


class PipelineExecutor:
    """Executes this rank's share of ``program`` under ``schedule``.

    Args:
        program: the split model (every rank builds the same one from the same capture).
        schedule: which order to run microbatches in; ``schedule.stages`` must equal the number of
            stages. It is simulated once here (deadlock and matching checks) before anything runs.
        axis: the comm axis of the pipeline group (default ``"pp"``; unbound = one rank).
        modules: stage index -> module to run instead of ``program.stages[s].gm`` (a stage graph
            rewritten by the tensor- or data-parallel pass); same calling convention.
        no_sync: context manager factory wrapping every backward but each stage's last in a step;
            default ``passes.ops.dp_ops.no_sync`` (defers data-parallel gradient reduction).
        record: keep a :class:`StepTrace` of the last step in ``self.trace``.
        dp_axis: the data-parallel axis; when bound to more than one rank, the returned loss is
            the mean over its replicas (each replica's batch is the same size), i.e. the loss of
            the global batch. ``None`` returns this replica's loss.
        device: where receive buffers and the reported loss are made (the engine passes its
            device: a CUDA device under NCCL); default ``cpu``.
        nccl_check: run every step under the NCCL semantics checker (gloo only); default: on when
            the environment sets ``FAIRSCALE_NCCL_CHECK=1``.
    """

    def __init__(self, program: StagedProgram, schedule: PipelineSchedule, *, axis: str = "pp",
                 modules: Mapping[int, nn.Module] | None = None,
                 no_sync: Callable[[], ContextManager[Any]] | None = None, record: bool = False,
                 dp_axis: str | None = "dp", device: torch.device | str | None = None,
                 nccl_check: bool | None = None) -> None:
        n = len(program.stages)
        if schedule.stages != n:
            raise PipelineError(f"the schedule has {schedule.stages} stages but the program has {n}; "
                                f"plan stages must number pp × virtual_stages")
        pp = comm.group_size(axis)
        if schedule.pp != pp:
            raise PipelineError(f"the schedule is for pp={schedule.pp} ranks but axis {axis!r} has {pp}")
        send_specs, recv_specs = program.boundary_specs()
        # raises ScheduleError (deadlock, unmatched message, boundary shapes) before anything is sent
        simulate(schedule, send_specs=send_specs, recv_specs=recv_specs)
        self.program = program
        self.schedule = schedule
        self.axis = axis
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        """Where receive buffers and the reported loss live (the engine's device)."""
        self.rank = comm.group_rank(axis)
        # raises P2POrderError if NCCL could mismatch or deadlock on the batches (never for the
        # registered kinds: schedule_batched orders them so; a hand-written schedule may)
        self.batched: list[Action | CommBatch] = check_nccl_order(schedule).steps[self.rank]
        """This rank's computes and point-to-point batches, in order (``planner.schedule_batched``)."""
        self._eval_batched: list[Action | CommBatch] = check_nccl_order(schedule.forward_only()).steps[self.rank]
        self.actions: list[Action] = [a for a in self.batched if isinstance(a, Action)]
        self.local_stages = schedule.rank_stages(self.rank)
        self.modules: dict[int, nn.Module] = {s: (modules or {}).get(s, program.stages[s].gm)
                                              for s in self.local_stages}
        # what this rank's stages receive and send: the captured boundary, with the rank-local
        # shapes of values a tensor-parallel rewrite sends as shards (sequence parallelism)
        self._links = StageLinks(
            schedule, axis=axis, rank=self.rank, stages=n, local_stages=self.local_stages,
            in_specs={s: local_specs(self.modules[s], program.stages[s].inputs, "received")
                      for s in self.local_stages},
            out_specs={s: local_specs(self.modules[s], program.stages[s].outputs, "sent")
                       for s in self.local_stages}, device=self.device)
        self.no_sync = no_sync or _default_no_sync()
        self.record = record
        self.dp_axis = dp_axis
        self.trace = StepTrace()
        self._shaken = False
        self._weights: list[float] | None = None
        self._step_count = 0
        self._state = StepState()
        self._check = nccl.checker(axis) if nccl.wanted(nccl_check) else None
        last_b: dict[int, Action] = {}
        for a in self.actions:
            if a.kind == "B":
                last_b[a.stage] = a
        self._last_backward = set(last_b.values())
        self._tied = TiedParams(program, schedule, axis=axis, modules=self.modules, local_stages=self.local_stages)
        self._tied.check()

    # --- public ---------------------------------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """Trainable parameters of this rank's stages (a tied copy appears once per stage)."""
        for s in self.local_stages:
            yield from (p for p in self.modules[s].parameters() if p.requires_grad)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters and buffers by user state_dict key (tied names expanded).

        FSDP flat shards (``shard_data_parallel_pass`` with kind fsdp) are all-gathered over their
        dp axis, so every dp replica must call this together. Tensor-parallel slices are refused.
        """
        out: dict[str, torch.Tensor] = {}
        for s in self.local_stages:
            layout = stage_layout(self.program, self.modules, s)
            if layout.tp:
                raise PipelineError(f"stage {s} holds tensor-parallel slices; gather them with the runtime's "
                                    "sharded state_dict instead of PipelineExecutor.state_dict")
            items: list[tuple[str, torch.Tensor]] = []
            for attr, key in layout.keys.items():
                items.append((key, fetch_attr(self.modules[s], attr).detach()))
            for attr, flat in layout.flat.items():
                shard = fetch_attr(self.modules[s], attr).detach()
                full = torch.empty(flat.padded, dtype=shard.dtype, device=shard.device)
                comm.all_gather_flat(full, shard.reshape(-1), flat.axis)
                items.extend(flat.split(full).items())
            for key, value in items:
                for name in self.program.aliases.get(key, [key]):
                    out[name] = value
        return out

    @torch.no_grad()
    def eval_step(self, batch: Sequence[Any], *, weights: Sequence[float] | None = None) -> float:
        """The mean loss of ``batch`` without backward (the forwards of the schedule alone, in
        microbatch order); same value on every rank, averaged over ``dp_axis`` replicas.
        ``weights``: each microbatch's weight, as for :meth:`step`."""
        micro = self._microbatches(batch, weights)
        self._run(self._eval_batched, micro, "eval", evaluation=True)
        return self._finish("eval")

    def step(self, batch: Sequence[Any], *, weights: Sequence[float] | None = None) -> float:
        """Forward and backward of ``batch`` (this dp replica's rows) over all microbatches;
        returns the step's mean loss on every rank (averaged over ``dp_axis`` replicas).
        Gradients accumulate into ``.grad`` (call ``zero_grad`` between steps).

        ``weights``: each microbatch's weight in this replica's loss (default ``1 / microbatches``
        each); the step's loss is ``sum(weights[i] * loss_i)`` averaged over dp. A token-mean loss
        whose microbatches count different numbers of labels needs them (``passes.loss_weights``)."""
        micro = self._microbatches(batch, weights)
        self.trace = StepTrace(start=time.perf_counter())
        where = f"step {self._step_count}"
        self._step_count += 1
        self._run(self.batched, micro, where, evaluation=False)
        RECORDER.context = f"{where}, tied-weight gradients"
        self._tied.sum_grads(check=self._check)
        out = self._finish(where)
        self.trace.end = time.perf_counter()
        return out

    def _microbatches(self, batch: Sequence[Any], weights: Sequence[float] | None) -> list[tuple[Any, ...]]:
        """What :meth:`step` and :meth:`eval_step` start with: ``batch`` cut into the schedule's
        microbatches, their ``weights`` kept for the loss, and the neighbours' boundary handshake
        on the first call."""
        m = self.schedule.microbatches
        if weights is not None and len(weights) != m:
            raise ValueError(f"{len(weights)} microbatch weights for {m} microbatches")
        self._weights = list(weights) if weights is not None else None
        micro = split_microbatches(batch, m, self.program, self.local_stages)
        if not self._shaken:
            self._links.handshake()
            self._shaken = True
        return micro

    def _run(self, program: Sequence[Action | CommBatch], micro: list[tuple[Any, ...]], where: str, *,
             evaluation: bool) -> None:
        st = self._state = StepState()
        last = ""
        for item in program:
            if isinstance(item, CommBatch):
                RECORDER.context = f"{where}, after {last}" if last else f"{where}, start"
                self._post(item, st, evaluation=evaluation)
                continue
            last = item.token()
            RECORDER.context = f"{where}, {last}"
            if item.kind == "F":
                self._do_F(item, micro, st)
            else:
                self._do_B(item, micro, st)
        for b in st.sends:
            b.wait()

    def _finish(self, where: str) -> float:
        """The step's end: the NCCL semantics check of all pipeline ranks' batches (when on), then the loss."""
        if self._check is not None:
            RECORDER.context = f"{where}, NCCL semantics check"
            self._check.end_step(where)
        RECORDER.context = f"{where}, loss"
        out = self._report_loss(self._state.losses)
        self._state = StepState()
        RECORDER.context = f"{where}, after the pipeline (optimizer, clipping)"
        return out

    def _report_loss(self, losses: list[torch.Tensor]) -> float:
        """Mean of the last stage's microbatch losses, broadcast over pp and averaged over dp."""
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        if losses:
            if self._weights is None:
                loss = torch.stack([x.double() for x in losses]).sum() / self.schedule.microbatches
            else:
                # a piece that counts no labels weighs 0, and its own mean is 0/0: left out, not 0·nan
                mbs = self._state.loss_microbatches
                kept = [x.double() * self._weights[mb] for x, mb in zip(losses, mbs) if self._weights[mb]]
                loss = torch.stack(kept).sum() if kept else loss
        comm.broadcast_(loss, self.axis, src_rank=self.schedule.stage_rank(len(self.program.stages) - 1))
        if self.dp_axis is not None and comm.group_size(self.dp_axis) > 1:
            comm.all_reduce_(loss, self.dp_axis)
            loss /= comm.group_size(self.dp_axis)
        return float(loss.item())

    # --- actions --------------------------------------------------------------------------------

    def _do_F(self, a: Action, micro: list[tuple[Any, ...]], st: StepState) -> None:
        stage = self.program.stages[a.stage]
        if a.stage == 0:
            received: list[torch.Tensor] = []
        elif self.schedule.stage_rank(a.stage - 1) == self.rank:
            received = [t.detach() for t in st.outputs[(a.mb, a.stage - 1)]]
        else:
            received = self._received(st, ("F", a.mb, a.stage))
        for t, spec in zip(received, stage.inputs):
            if spec.grad:
                t.requires_grad_(True)
        args = [micro[a.mb][i] for i in stage.batch_inputs]
        t0 = time.perf_counter()
        out = self.modules[a.stage](*args, *received)
        if self.record:
            self.trace.compute.append((a.token(), t0, time.perf_counter()))
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        check_values(out, self._links.out_specs[a.stage], f"stage {a.stage} output")
        st.inputs[(a.mb, a.stage)] = received
        st.outputs[(a.mb, a.stage)] = out
        if a.stage == len(self.program.stages) - 1:
            st.losses.append(out[0].detach())
            st.loss_microbatches.append(a.mb)

    def _do_B(self, a: Action, micro: list[tuple[Any, ...]], st: StepState) -> None:
        stage = self.program.stages[a.stage]
        out = st.outputs.pop((a.mb, a.stage))
        last = a.stage == len(self.program.stages) - 1
        if last:
            tensors = [out[0]]
            seed = 1.0 / self.schedule.microbatches if self._weights is None else self._weights[a.mb]
            grads: list[torch.Tensor] = [torch.full_like(out[0], seed)]
        else:
            if self.schedule.stage_rank(a.stage + 1) == self.rank:
                got = st.local_grads.pop((a.mb, a.stage + 1))
            else:
                got = self._received(st, ("B", a.mb, a.stage))
            tensors, grads = [], []
            pairs = [(o, s) for o, s in zip(out, stage.outputs) if s.grad]
            for (o, _), g in zip(pairs, got):
                if o.requires_grad:
                    tensors.append(o)
                    grads.append(g)
        t0 = time.perf_counter()
        ctx = contextlib.nullcontext() if a in self._last_backward else self.no_sync()
        with ctx:
            if tensors:
                torch.autograd.backward(tensors, grads)
        if self.record:
            self.trace.compute.append((a.token(), t0, time.perf_counter()))
        inputs = st.inputs.pop((a.mb, a.stage))
        if a.stage > 0:
            in_grads = [t.grad if t.grad is not None else torch.zeros_like(t)
                        for t, s in zip(inputs, stage.inputs) if s.grad]
            if self.schedule.stage_rank(a.stage - 1) == self.rank:
                st.local_grads[(a.mb, a.stage)] = in_grads
            else:
                st.grads_out[(a.mb, a.stage)] = in_grads

    def _post(self, batch: CommBatch, st: StepState, *, evaluation: bool) -> None:
        """Post one batch of sends and receives (``batch_isend_irecv``, in the batch's agreed order)."""
        messages: list[p2p.Message] = []
        receives: list[tuple[tuple[str, int, int], list[p2p.Message]]] = []
        for a in batch.actions:
            if a.kind == "SF":
                messages += self._links.send_forward(a.mb, a.stage, st.outputs[(a.mb, a.stage)])
                if evaluation:  # nothing comes back in evaluation: drop the sent activations
                    st.outputs.pop((a.mb, a.stage))
                    st.inputs.pop((a.mb, a.stage), None)
            elif a.kind == "SB":
                messages += self._links.send_backward(a.mb, a.stage, st.grads_out.pop((a.mb, a.stage)))
            else:
                got = (self._links.recv_forward if a.kind == "RF" else self._links.recv_backward)(a.mb, a.stage)
                receives.append(((a.kind[1], a.mb, a.stage), got))
                messages += got
        posted = p2p.exchange(messages, group=comm.get_group(self.axis), axis=self.axis, check=self._check)
        if any(m.send for m in messages):
            st.sends.append(posted)
        for key, got in receives:
            st.recvs[key] = (posted, [m.tensor for m in got])

    @staticmethod
    def _received(st: StepState, key: tuple[str, int, int]) -> list[torch.Tensor]:
        posted, buffers = st.recvs.pop(key)
        posted.wait()
        return buffers


def _default_no_sync() -> Callable[[], ContextManager[Any]]:
    try:
        from passes.ops.dp_ops import no_sync
    except ImportError:  # no data-parallel ops installed: nothing reads the flag
        return contextlib.nullcontext
    return no_sync
