"""Pipeline-schedule arithmetic: step time from per-stage times, bubble fraction, microbatches in flight.

Notation: ``p`` pipeline ranks, ``m`` microbatches per step, ``v`` model chunks per rank
(interleaved only, 1 otherwise), ``t_j`` the time of one microbatch's forward + backward on rank
``j`` (its v chunks together), seconds. The schedules as action lists live in
``planner.schedule``; this module only holds the closed forms the search needs.

Sources: GPipe (Huang et al. 2019, §2.3: bubble O((p-1)/(m+p-1))); 1F1B / PipeDream-Flush and
the interleaved schedule (Narayanan et al. 2021, §2.2.1-2.2.2: bubble (p-1)/m of the ideal time,
divided by v when interleaved; 1F1B keeps at most p microbatches in flight).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

__all__ = ["SCHEDULE_KINDS", "pipeline_time", "bubble_fraction", "in_flight", "stage_placement"]

SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved", "v")


def stage_placement(kind: str, p: int, v: int = 1) -> list[int]:
    """Pipeline rank of each of the ``p·v`` stages: looped (``s % p``), or for ``v`` down and back
    up (``0 1 … p-1 p-1 … 1 0``)."""
    if kind == "v":
        return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    return [s % p for s in range(p * v)]


@lru_cache(maxsize=256)
def _v_profile(p: int, m: int) -> tuple[float, tuple[float, ...]]:
    """(bubble at equal stage costs, peak microbatches in flight per rank) of the list-scheduled V
    schedule, read off its action lists and timeline (``planner.schedule.v_shape_timed``)."""
    from planner.schedule import v_shape_timed

    sched, span = v_shape_timed(p, m)
    peaks = []
    for actions in sched.actions:
        live = peak = 0
        for a in actions:
            if a.kind == "F":
                live += 1
            elif a.kind == "B":
                live -= 1
            peak = max(peak, live)
        peaks.append(peak / 2)  # each chunk holds half of the rank's layers
    return 1.0 - 6.0 * m / span, tuple(peaks)  # every rank is busy 2 chunks × m × (F 1 + B 2) = 6m


def pipeline_time(kind: str, stage_times: Sequence[float], m: int, *, v: int = 1) -> float:
    """Seconds from the first forward to the last backward of one step.

    gpipe / 1f1b: ``(m-1)·max_j t_j + Σ_j t_j`` — the first microbatch crosses every stage once,
    the remaining m-1 leave at the pace of the slowest stage (equals (m+p-1)·t when balanced).
    interleaved: ``m·max_j t_j + (Σ_j t_j - max_j t_j)/v`` — the fill and drain cross chunks of
    1/v the size (equals (m + (p-1)/v)·t when balanced).
    v: ``m·max_j t_j + c·(Σ_j t_j - max_j t_j)`` with ``c = m·b / ((1-b)(p-1))``, ``b`` the bubble of
    the list-scheduled V timeline at equal stage costs, so that balanced stages give exactly the
    simulated step ``m·t/(1-b)``.
    """
    _check(kind, len(stage_times), m, v)
    t_max = max(stage_times)
    total = sum(stage_times)
    p = len(stage_times)
    if kind == "interleaved":
        return m * t_max + (total - t_max) / v
    if kind == "v":
        if p == 1:
            return m * t_max
        b = _v_profile(p, m)[0]
        return m * t_max + m * b / ((1 - b) * (p - 1)) * (total - t_max)
    return (m - 1) * t_max + total


def bubble_fraction(kind: str, p: int, m: int, *, v: int = 1) -> float:
    """Idle fraction of the step for balanced stages: ``(p-1)/v / (m + (p-1)/v)`` (dimensionless).

    Narayanan et al. 2021 write the bubble as (p-1)/m of the ideal time; as a fraction of the
    whole step that is (p-1)/(m+p-1), and interleaving divides the fill and drain by v.
    """
    _check(kind, p, m, v)
    if kind == "v":
        return _v_profile(p, m)[0] if p > 1 else 0.0
    fill = (p - 1) / (v if kind == "interleaved" else 1)
    return fill / (m + fill)


def in_flight(kind: str, p: int, m: int, stage: int, *, v: int = 1) -> float:
    """Microbatches whose activations rank ``stage`` (0-based) holds at its peak, in units of one
    microbatch through all of the rank's layers.

    gpipe: all ``m`` (every forward runs before any backward).
    1f1b: ``min(m, p - stage)`` (the warm-up depth of PipeDream-Flush).
    interleaved: Megatron-LM's warm-up count of chunk-microbatches,
    ``min(m·v, 2·(p - stage - 1) + (v - 1)·p + 1)``, each holding 1/v of the rank's layers.
    v: the peak of chunk-microbatches alive in the rank's action list, each half of its layers.
    """
    _check(kind, p, m, v)
    if not 0 <= stage < p:
        raise ValueError(f"stage {stage} is outside 0..{p - 1}")
    if kind == "gpipe":
        return float(m)
    if kind == "1f1b":
        return float(min(m, p - stage))
    if kind == "v":
        return _v_profile(p, m)[1][stage]
    chunks = min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
    return chunks / v


def _check(kind: str, p: int, m: int, v: int) -> None:
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"unknown schedule {kind!r}; use one of {', '.join(SCHEDULE_KINDS)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline ranks ({p}), microbatches ({m}) and chunks ({v}) must be >= 1")
    if kind == "v" and v != 2:
        raise ValueError(f"the v schedule places 2 chunks on each rank, not virtual_stages={v}")
    if kind not in ("interleaved", "v") and v != 1:
        raise ValueError(f"virtual_stages={v} needs the interleaved schedule, not {kind}")
