"""A schedule's point-to-point in NCCL's order: sends and receives grouped into batches that both
ranks of every pair post alike (one ``batch_isend_irecv`` each, no tags).

NCCL matches messages per rank pair in posting order and makes a send wait for the peer's
receive (``planner.p2p_model``), so the receive-early, send-late order of
:meth:`PipelineSchedule.lower` (right for tagged gloo messages) deadlocks 1F1B and GPipe there,
and the V schedule's messages would even meet the wrong receives. ``torch.distributed.pipelining``
and Megatron-LM pair each compute's sends with the receives the neighbours need at the same
moment, in one batched call; this is that rule, derived from any schedule:

1. Place every compute in time (:func:`planner.schedule_sim.simulate`, F = 1, B = 2 per stage).
2. A message leaves when the compute that produced it ends, at time τ. Its sender posts the
   send, and its receiver the receive, in their batches *at τ*: each rank has one batch per τ at
   which it sends or receives, holding those sends and receives sorted by message (kind,
   microbatch, sending stage), the same key on both sides.
3. Each rank's program is its computes in schedule order with its batches among them by time; a
   batch at τ comes before a compute that starts at τ.

Why it cannot deadlock, with every batch run to completion before the rank moves on (NCCL's
strictest reading): order all items by (time, batch before compute). Assume every item before
(τ, batch) has completed on every rank. Then every rank's batch at τ is at the head of its
program (what precedes it on its rank is earlier), and every message in it has its partner in the
peer's batch at τ, so all those batches complete together. A compute at (s, compute) needs only
messages of batches at τ ≤ s, which come before it. By induction every item completes, and per
pair the messages are in (τ, key) order on both sides, so they match in FIFO order.

Text form: a batch is bracketed, e.g. 1F1B on 2 ranks, rank 0: ``F0 [SF0] F1 [SF1] [RB0] B0 [RB1] B1``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Union

from planner.p2p_model import P2PBatch, P2POp, check_p2p
from planner.schedule_ir import Action, PipelineSchedule, ScheduleError
from planner.schedule_sim import simulate

__all__ = ["CommBatch", "Step", "BatchedProgram", "batch_p2p", "message_key", "peer_stage", "check_nccl_order"]


@dataclass(frozen=True)
class CommBatch:
    """The sends and receives one rank posts together, at model time ``time``."""

    time: float
    actions: tuple[Action, ...]
    """``SF``/``SB``/``RF``/``RB`` actions, sorted by :func:`message_key`."""

    def token(self, *, with_stage: bool = True) -> str:
        return "[" + " ".join(a.token(with_stage=with_stage) for a in self.actions) + "]"


Step = Union[Action, CommBatch]
"""One item of a rank's batched program: a compute (``F``/``B``) or a batch of messages."""


def message_key(a: Action) -> tuple[str, int, int]:
    """The message a comm action sends or receives, named alike on both sides: (``F`` for an
    activation or ``B`` for a gradient, microbatch, sending stage)."""
    if a.kind == "SF" or a.kind == "SB":
        return a.kind[1], a.mb, a.stage
    if a.kind == "RF":
        return "F", a.mb, a.stage - 1
    if a.kind == "RB":
        return "B", a.mb, a.stage + 1
    raise ScheduleError(f"{a} is not a send or receive")


def peer_stage(a: Action) -> int:
    """The stage on the other side of a comm action."""
    return a.stage + (1 if a.kind in ("SF", "RB") else -1)


@dataclass
class BatchedProgram:
    """Every rank's program with its point-to-point in batches (see the module docstring)."""

    schedule: PipelineSchedule
    steps: list[list[Step]]
    """``steps[r]``: rank r's computes and batches, in order."""

    def rank_text(self, rank: int) -> str:
        short = self.schedule.virtual_stages == 1
        return " ".join(s.token(with_stage=not short) for s in self.steps[rank])

    def to_text(self) -> str:
        return "\n".join(f"rank {r}: {self.rank_text(r)}" for r in range(self.schedule.pp)) + "\n"

    def p2p_programs(self) -> list[list[P2PBatch]]:
        """The batches as :mod:`planner.p2p_model` sees them (ranks are pipeline ranks)."""
        out: list[list[P2PBatch]] = []
        sched = self.schedule
        for r, steps in enumerate(self.steps):
            prog, last = [], "the start"
            for step in steps:
                if isinstance(step, Action):
                    last = step.token()
                    continue
                ops = tuple(_op(sched, a) for a in step.actions)
                prog.append(P2PBatch(ops, where=f"after {last}"))
            out.append(prog)
        return out


def _op(sched: PipelineSchedule, a: Action) -> P2POp:
    kind, mb, src = message_key(a)
    dst = src + (1 if kind == "F" else -1)
    return P2POp(send=a.kind[0] == "S", peer=sched.stage_rank(peer_stage(a)), message=f"{kind}{mb} {src}→{dst}",
                 action=a.token())


def batch_p2p(schedule: PipelineSchedule) -> BatchedProgram:
    """``schedule``'s computes with its messages in NCCL-safe batches (module docstring)."""
    sched = schedule.compute_only() if schedule.lowered else schedule
    timeline = simulate(sched, f_cost=1.0, b_cost=2.0)
    last = sched.stages - 1
    batches: list[dict[float, list[Action]]] = [defaultdict(list) for _ in range(sched.pp)]
    items: list[list[tuple[tuple[float, int, int], Step]]] = [[] for _ in range(sched.pp)]
    for i, slot in enumerate(timeline.slots):
        a, r = slot.action, slot.rank
        items[r].append(((slot.start, 1, i), a))
        to = a.stage + 1 if a.kind == "F" else a.stage - 1
        if not 0 <= to <= last or sched.stage_rank(to) == r:
            continue  # the loss end of the pipeline, or a boundary inside this rank
        batches[r][slot.end].append(Action("S" + a.kind, a.mb, a.stage))
        batches[sched.stage_rank(to)][slot.end].append(Action("R" + a.kind, a.mb, to))
    for r in range(sched.pp):
        for t, acts in batches[r].items():
            items[r].append(((t, 0, 0), CommBatch(t, tuple(sorted(acts, key=message_key)))))
    steps = [[step for _, step in sorted(rank_items, key=lambda item: item[0])] for rank_items in items]
    for r, prog in enumerate(steps):  # the timeline keeps each rank's compute order; say so if not
        if [s for s in prog if isinstance(s, Action)] != sched.actions[r]:
            raise ScheduleError(f"rank {r}: the batched program reorders the schedule's computes")
    return BatchedProgram(schedule=sched, steps=steps)


def check_nccl_order(schedule: PipelineSchedule) -> BatchedProgram:
    """:func:`batch_p2p` of ``schedule``, checked by :func:`planner.p2p_model.check_p2p` (raises
    ``P2POrderError`` on a mismatch or deadlock under NCCL's semantics)."""
    program = batch_p2p(schedule)
    check_p2p(program.p2p_programs())
    return program
