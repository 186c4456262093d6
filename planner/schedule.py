"""Pipeline schedules as data: per-rank action lists, their text form, a checker and a timeline.

A schedule says, for every pipeline rank, in which order it runs the forward (``F``) and backward
(``B``) of each microbatch on each of its stages. Stage ``s`` lives on rank ``s % pp`` (with
``virtual_stages = v`` a rank holds stages ``r, r + pp, …, r + (v-1)·pp``, Megatron's
"interleaved" placement), or on ``placement[s]`` (the V shape: 0 1 … p-1 p-1 … 1 0).
The kinds (``gpipe``, ``1f1b``, ``interleaved`` with v ≥ 2, ``v`` with v = 2) are registered in
``planner.schedule_kinds``; the data types live in ``planner.schedule_ir``, the builders in
``planner.schedule_builders``, the checker in ``planner.schedule_sim``; this module is their face.
:meth:`PipelineSchedule.lower` inserts the point-to-point actions:

==========  ======================================================================
token       meaning
==========  ======================================================================
``F3``      forward of microbatch 3 on the rank's stage (``F3@2``: on stage 2)
``B3``      backward of microbatch 3
``SF3``     send stage's output activations of microbatch 3 to the next stage
``RF3``     receive the stage's input activations of microbatch 3
``SB3``     send the gradient of the stage's inputs back to the previous stage
``RB3``     receive the gradient of the stage's outputs from the next stage
==========  ======================================================================

The ``@stage`` suffix is left out when the rank holds one stage. 1F1B on 4 ranks and 4
microbatches, F costing 1 and B costing 2 time units (``format_gantt``)::

    rank 0 | F0 F1 F2 F3 .  .  .  B0 B0 .  B1 B1 .  B2 B2 .  B3 B3
    rank 1 | .  F0 F1 F2 .  .  B0 B0 F3 B1 B1 .  B2 B2 B3 B3 .  .
    …

:func:`simulate` (``planner.schedule_sim``) runs the lowered lists in one process, with sends that
do not block and receives that wait for their message (each message matched by name). It raises
:class:`ScheduleError` on a deadlock (naming what each rank waits for), on a receive that no send
matches, on a missing or duplicated action, and on send/receive shapes that disagree. It returns a
:class:`Timeline`, the start and end of every action for given per-stage costs; its ``bubble`` is
the measured idle fraction that the planner's formula (:func:`predicted_bubble`) approximates.

What the executor runs is :func:`batch_p2p`'s program (``planner.schedule_batched``): the same
computes, with the sends and receives grouped into batches that both ranks of a pair post alike,
in an order NCCL can run (messages matched per rank pair in order, sends that wait for the peer's
receive); :func:`check_nccl_order` proves that with ``planner.p2p_model``. Batches print in
brackets: ``F0 [SF0] F1 [SF1 RB0] B0``.

Usage::

    sched = build_schedule("1f1b", pp=4, microbatches=8)
    print(sched.format())                       # one row of tokens per rank
    tl = simulate(sched.lower(), f_cost=1, b_cost=2)
    print(tl.format_gantt()); tl.bubble         # 3 / 11 for GPipe and 1F1B
    print(check_nccl_order(sched).to_text())    # what each rank posts, batch by batch
"""

from __future__ import annotations

from planner.plan import Plan
from planner.schedule_builders import gpipe, interleaved_1f1b, one_f_one_b, v_shape, v_shape_timed
from planner.schedule_ir import COMM, COMPUTE, Action, PipelineSchedule, ScheduleError, parse_actions
from planner.schedule_kinds import KINDS, kind_of
from planner.p2p_model import P2POrderError
from planner.schedule_batched import BatchedProgram, CommBatch, batch_p2p, check_nccl_order
from planner.schedule_sim import Slot, Timeline, simulate

__all__ = [
    "Action", "PipelineSchedule", "ScheduleError", "Timeline", "Slot", "build_schedule", "schedule_for", "gpipe",
    "one_f_one_b", "interleaved_1f1b", "v_shape", "v_shape_timed", "simulate", "predicted_bubble", "parse_actions",
    "batch_p2p", "check_nccl_order", "BatchedProgram", "CommBatch", "P2POrderError", "KINDS", "COMPUTE", "COMM",
]


def build_schedule(kind: str, *, pp: int, microbatches: int, virtual_stages: int = 1) -> PipelineSchedule:
    """The schedule ``kind`` (a name in ``planner.schedule_kinds.KINDS``) for ``pp`` ranks; the
    plan's ``schedule`` block maps onto these arguments one to one."""
    return kind_of(kind).build(pp, microbatches, virtual_stages)


def schedule_for(plan: Plan) -> PipelineSchedule:
    """The schedule a plan asks for: ``plan.schedule`` (kind, microbatches, virtual_stages) on
    ``plan.mesh.pp`` ranks."""
    return build_schedule(plan.schedule.kind, pp=plan.mesh.pp, microbatches=plan.schedule.microbatches,
                          virtual_stages=plan.schedule.virtual_stages)


def predicted_bubble(kind: str, *, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of the step with equal stage costs (``ScheduleKind.bubble``): ``(p-1)/(m+p-1)``
    for GPipe and 1F1B (Huang et al. 2019, section 2.3), ``(p-1)/(v·m+p-1)`` for interleaved
    (Narayanan et al. 2021, section 2.2.2), and the list-scheduled ``v``'s simulated timeline at F = 1,
    B = 2 per stage."""
    k = kind_of(kind)
    k.check(pp, microbatches, virtual_stages)
    return k.bubble(pp, microbatches, virtual_stages)
