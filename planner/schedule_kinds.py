"""The registry of pipeline schedule kinds: everything that depends on a plan's ``schedule.kind``.

Each kind is one class holding, in one place, what the rest of the planner asks of it:

==================  ===========================================================================
``build``           its action lists (the algorithm lives in ``planner.schedule_builders``)
``problems``        what a plan must satisfy (chunks per rank, microbatches), one message each
``placement``       which pipeline rank runs each stage
``pipeline_time``   step time from per-rank times (closed form)
``bubble``          idle fraction with balanced stages
``in_flight``       microbatches whose activations a rank holds at its peak
``offer``           the chunk counts the search tries for a (pp, microbatches, layers)
``fallback_offer``  what it tries only when nothing else can be planned (fewer microbatches than stages)
``order``           preference among equally fast plans (lower first)
==================  ===========================================================================

Adding a kind means writing its builder and one class here, then listing it in :data:`KINDS`;
validation, the search, the cost model, the report and the runtime read it from here.

Notation: ``p`` pipeline ranks, ``m`` microbatches per step, ``v`` model chunks per rank, ``t_j``
the time of one microbatch's forward + backward on rank ``j`` (its v chunks together), seconds.
Sources: GPipe (Huang et al. 2019, §2.3: bubble (p-1)/(m+p-1)); 1F1B / PipeDream-Flush and the
interleaved schedule (Narayanan et al. 2021, §2.2.1-2.2.2: bubble (p-1)/m of the ideal time,
divided by v when interleaved; 1F1B keeps at most p microbatches in flight); V (Qi et al. 2024).
"""

from __future__ import annotations

from functools import lru_cache
from typing import ClassVar, Sequence

from planner.schedule_builders import gpipe, interleaved_1f1b, one_f_one_b, v_placement, v_shape_timed
from planner.schedule_ir import PipelineSchedule, ScheduleError

__all__ = ["ScheduleKind", "KINDS", "kind_of", "VIRTUAL_CHOICES", "V_MAX_PP", "V_MICRO_PER_RANK"]

VIRTUAL_CHOICES = (2, 4, 8)
"""Chunks per rank the search tries for the interleaved schedule."""
V_MICRO_PER_RANK, V_MAX_PP = 2, 16
"""Unless asked for, the search offers the V schedule only up to 2 microbatches per pipeline rank
and 16 ranks: V beats 1F1B only on the bubble, (p-1)/(m+p-1) of the step, under a third beyond
m = 2p, while the ranks at its turn hold all m microbatches (twice 1F1B's worst at m = 2p); and
costing it list-schedules its timeline (:func:`_v_profile`), whose size grows with p·m, for every
(p, m) the search meets."""


class ScheduleKind:
    """One schedule kind. Subclasses set ``name``, ``summary``, ``order`` and the methods below."""

    name: ClassVar[str]
    summary: ClassVar[str]
    """One line for error messages and docs."""
    order: ClassVar[int]

    # --- the plan's rules -------------------------------------------------------------------------

    def chunk_problem(self, v: int) -> str | None:
        """What is wrong with ``v`` model chunks per rank for this kind (None: fine)."""
        if v != 1:
            return (f'{v} model chunks per pipeline rank need kind "interleaved", but schedule.kind is '
                    f'"{self.name}"; set kind to "interleaved" or virtual_stages to 1')
        return None

    def microbatch_problem(self, p: int, m: int) -> str | None:
        """What is wrong with ``m`` microbatches on ``p`` pipeline ranks (None: fine)."""
        return None

    def problems(self, p: int, m: int, v: int) -> list[tuple[str, str]]:
        """Every rule the plan breaks, as (field of ``schedule``, message)."""
        out = []
        if (chunks := self.chunk_problem(v)) is not None:
            out.append(("virtual_stages", chunks))
        if (micro := self.microbatch_problem(p, m)) is not None:
            out.append(("microbatches", micro))
        return out

    def check(self, p: int, m: int, v: int) -> None:
        """Raise :class:`ScheduleError` on the first broken rule (sizes first)."""
        if p < 1 or m < 1 or v < 1:
            raise ScheduleError(f"pp ({p}), microbatches ({m}) and virtual_stages ({v}) must be >= 1")
        for fld, message in self.problems(p, m, v):
            raise ScheduleError(f"schedule.{fld}: {message}")

    # --- what it is -------------------------------------------------------------------------------

    def build(self, p: int, m: int, v: int) -> PipelineSchedule:
        raise NotImplementedError(f"schedule kind {self.name!r} has no builder")

    def placement(self, p: int, v: int) -> list[int]:
        """Pipeline rank of each of the ``p·v`` stages: looped (``s % p``, Megatron's placement)."""
        return [s % p for s in range(p * v)]

    def pipeline_time(self, stage_times: Sequence[float], m: int, v: int) -> float:
        """gpipe / 1f1b: ``(m-1)·max_j t_j + Σ_j t_j``: the first microbatch crosses every stage
        once, the remaining m-1 leave at the pace of the slowest (equals (m+p-1)·t when balanced)."""
        return (m - 1) * max(stage_times) + sum(stage_times)

    def bubble(self, p: int, m: int, v: int) -> float:
        """``(p-1)/(m+p-1)``: Narayanan et al.'s (p-1)/m of the ideal time, as a share of the step."""
        return (p - 1) / (m + p - 1)

    def in_flight(self, p: int, m: int, stage: int, v: int) -> float:
        raise NotImplementedError(f"schedule kind {self.name!r} does not say its in-flight microbatches")

    # --- the search ---------------------------------------------------------------------------------

    def offer(self, p: int, m: int, layers: int, *, asked: bool, chunks: int | None) -> list[int]:
        """Chunk counts the search tries (empty: not offered). ``asked``: the constraints name this
        kind; ``chunks``: they fix virtual_stages."""
        return []

    def fallback_offer(self, p: int, m: int) -> list[int]:
        """Chunk counts the search tries only when no plan with at least as many microbatches as
        pipeline ranks exists (a batch too small for the stages the model needs to fit)."""
        return []

    def label(self, v: int) -> str:
        """How the search table names a configuration of this kind."""
        return self.name


class GPipe(ScheduleKind):
    name = "gpipe"
    summary = "all forwards, then all backwards (Huang et al. 2019)"
    order = 3

    def build(self, p: int, m: int, v: int) -> PipelineSchedule:
        self.check(p, m, v)
        return gpipe(p, m)

    def in_flight(self, p: int, m: int, stage: int, v: int) -> float:
        """All ``m``: every forward runs before any backward."""
        return float(m)

    def offer(self, p: int, m: int, layers: int, *, asked: bool, chunks: int | None) -> list[int]:
        # GPipe has 1F1B's step time and more activations in flight, so it runs only when asked for
        return [1] if asked else []

    def fallback_offer(self, p: int, m: int) -> list[int]:
        # fewer microbatches than stages: 1F1B cannot fill the pipeline, GPipe runs them through
        # ((p-1)/(m+p-1) idle); the search says why it had to
        return [1] if p > 1 and m < p else []


class OneFOneB(ScheduleKind):
    name = "1f1b"
    summary = "one forward, one backward after a warm-up of pp - rank - 1 forwards (PipeDream-Flush)"
    order = 0

    def microbatch_problem(self, p: int, m: int) -> str | None:
        if m < p:
            return (f"1f1b with pp({p}) needs at least {p} microbatches, got {m}: its warm-up sends one "
                    f"microbatch into each of the {p} stages before the first backward, so with fewer the "
                    f'pipeline never fills; use {p} or more, or kind "gpipe"')
        return None

    def build(self, p: int, m: int, v: int) -> PipelineSchedule:
        if (chunks := self.chunk_problem(v)) is not None:
            raise ScheduleError(f"schedule.virtual_stages: {chunks}")
        return one_f_one_b(p, m)

    def in_flight(self, p: int, m: int, stage: int, v: int) -> float:
        """``min(m, p - stage)``: the warm-up depth of PipeDream-Flush."""
        return float(min(m, p - stage))

    def offer(self, p: int, m: int, layers: int, *, asked: bool, chunks: int | None) -> list[int]:
        return [1] if m >= p else []


class Interleaved(ScheduleKind):
    name = "interleaved"
    summary = "1F1B over v >= 2 looped model chunks per rank (Megatron-LM, Narayanan et al. 2021)"
    order = 1

    def chunk_problem(self, v: int) -> str | None:
        if v < 2:
            return (f'"interleaved" places 2 or more model chunks on each pipeline rank, got virtual_stages {v}; '
                    'set virtual_stages to 2 or more, or use kind "1f1b" for one chunk per rank')
        return None

    def microbatch_problem(self, p: int, m: int) -> str | None:
        if m % p:
            return (f"interleaved runs microbatches in rounds of pp({p}) (Narayanan et al. 2021, sec. 2.2), so "
                    f"it needs a multiple of {p}; {m} % {p} = {m % p} (use {m + (-m) % p})")
        return None

    def build(self, p: int, m: int, v: int) -> PipelineSchedule:
        self.check(p, m, v)
        return interleaved_1f1b(p, m, v)

    def pipeline_time(self, stage_times: Sequence[float], m: int, v: int) -> float:
        """``m·max_j t_j + (Σ_j t_j - max_j t_j)/v``: fill and drain cross chunks of 1/v the size
        (equals (m + (p-1)/v)·t when balanced)."""
        t_max = max(stage_times)
        return m * t_max + (sum(stage_times) - t_max) / v

    def bubble(self, p: int, m: int, v: int) -> float:
        """``((p-1)/v) / (m + (p-1)/v)``: interleaving divides the fill and drain by v."""
        fill = (p - 1) / v
        return fill / (m + fill)

    def in_flight(self, p: int, m: int, stage: int, v: int) -> float:
        """Megatron-LM's warm-up count of chunk-microbatches, ``min(m·v, 2·(p - stage - 1) +
        (v - 1)·p + 1)``, each holding 1/v of the rank's layers."""
        return min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1) / v

    def offer(self, p: int, m: int, layers: int, *, asked: bool, chunks: int | None) -> list[int]:
        if p == 1 or m % p:
            return []
        return [v for v in ([chunks] if chunks else VIRTUAL_CHOICES) if v > 1 and p * v <= layers]

    def label(self, v: int) -> str:
        return f"{self.name}×{v}"


class VShape(ScheduleKind):
    name = "v"
    summary = "two chunks per rank placed down and back up, list-scheduled (Qi et al. 2024)"
    order = 2

    def chunk_problem(self, v: int) -> str | None:
        if v != 2:
            return (f'kind "v" places two chunks on each pipeline rank (down, then back up), so it needs '
                    f"virtual_stages 2, got {v}")
        return None

    def build(self, p: int, m: int, v: int) -> PipelineSchedule:
        self.check(p, m, v)
        return v_shape_timed(p, m)[0]

    def placement(self, p: int, v: int) -> list[int]:
        """Down and back up: ``0 1 … p-1 p-1 … 1 0``."""
        return v_placement(p)

    def pipeline_time(self, stage_times: Sequence[float], m: int, v: int) -> float:
        """``m·max_j t_j + c·(Σ_j t_j - max_j t_j)`` with ``c = m·b / ((1-b)(p-1))``, ``b`` the
        bubble of the list-scheduled timeline at equal stage costs, so that balanced stages give
        exactly the simulated step ``m·t/(1-b)``."""
        p, t_max = len(stage_times), max(stage_times)
        if p == 1:
            return m * t_max
        b = _v_profile(p, m)[0]
        return m * t_max + m * b / ((1 - b) * (p - 1)) * (sum(stage_times) - t_max)

    def bubble(self, p: int, m: int, v: int) -> float:
        """Read off the list scheduler's own timeline at F = 1, B = 2 per chunk (no closed form)."""
        return _v_profile(p, m)[0] if p > 1 else 0.0

    def in_flight(self, p: int, m: int, stage: int, v: int) -> float:
        """The peak of chunk-microbatches alive in the rank's action list, each half of its layers."""
        return _v_profile(p, m)[1][stage]

    def offer(self, p: int, m: int, layers: int, *, asked: bool, chunks: int | None) -> list[int]:
        if p == 1 or 2 * p > layers:
            return []
        return [2] if asked or (p <= V_MAX_PP and p <= m <= V_MICRO_PER_RANK * p) else []


@lru_cache(maxsize=256)
def _v_profile(p: int, m: int) -> tuple[float, tuple[float, ...]]:
    """(bubble at equal stage costs, peak microbatches in flight per rank) of the V schedule, read
    off its action lists and the list scheduler's makespan."""
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


KINDS: dict[str, ScheduleKind] = {k.name: k for k in (GPipe(), OneFOneB(), Interleaved(), VShape())}
"""Every schedule kind a plan can name, by name."""


def kind_of(name: str) -> ScheduleKind:
    """The kind called ``name``; a clear error for any other name."""
    try:
        return KINDS[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule kind {name!r}; choose from {', '.join(KINDS)}") from None
