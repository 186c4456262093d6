"""Pipeline-schedule arithmetic the search needs: step time from per-stage times, bubble fraction,
microbatches in flight, stage placement. Each is the schedule kind's own closed form
(``planner.schedule_kinds``, where the formulas and their sources live); this module checks the
arguments once and dispatches.

Notation: ``p`` pipeline ranks, ``m`` microbatches per step, ``v`` model chunks per rank (1 unless
the kind places several), ``t_j`` the time of one microbatch's forward + backward on rank ``j``
(its v chunks together), seconds.
"""

from __future__ import annotations

from typing import Sequence

from planner.schedule_kinds import KINDS, ScheduleKind

__all__ = ["SCHEDULE_KINDS", "pipeline_time", "bubble_fraction", "in_flight", "stage_placement"]

SCHEDULE_KINDS = tuple(KINDS)


def stage_placement(kind: str, p: int, v: int = 1) -> list[int]:
    """Pipeline rank of each of the ``p·v`` stages (a kind with a fixed chunk count, like ``v``,
    ignores ``v``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown schedule {kind!r}; use one of {', '.join(KINDS)}")
    return KINDS[kind].placement(p, v)


def pipeline_time(kind: str, stage_times: Sequence[float], m: int, *, v: int = 1) -> float:
    """Seconds from the first forward to the last backward of one step (``ScheduleKind.pipeline_time``)."""
    return _checked(kind, len(stage_times), m, v).pipeline_time(stage_times, m, v)


def bubble_fraction(kind: str, p: int, m: int, *, v: int = 1) -> float:
    """Idle fraction of the step for balanced stages (dimensionless; ``ScheduleKind.bubble``)."""
    return _checked(kind, p, m, v).bubble(p, m, v)


def in_flight(kind: str, p: int, m: int, stage: int, *, v: int = 1) -> float:
    """Microbatches whose activations rank ``stage`` (0-based) holds at its peak, in units of one
    microbatch through all of the rank's layers (``ScheduleKind.in_flight``)."""
    k = _checked(kind, p, m, v)
    if not 0 <= stage < p:
        raise ValueError(f"stage {stage} is outside 0..{p - 1}")
    return k.in_flight(p, m, stage, v)


def _checked(kind: str, p: int, m: int, v: int) -> ScheduleKind:
    if kind not in KINDS:
        raise ValueError(f"unknown schedule {kind!r}; use one of {', '.join(KINDS)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline ranks ({p}), microbatches ({m}) and chunks ({v}) must be >= 1")
    k = KINDS[kind]
    if (problem := k.chunk_problem(v)) is not None:
        raise ValueError(problem)
    return k
