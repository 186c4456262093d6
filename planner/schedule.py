"""Pipeline schedules as data: per-rank action lists, their text form, a checker and a timeline.

A schedule says, for every pipeline rank, in which order it runs the forward (``F``) and backward
(``B``) of each microbatch on each of its stages. Stage ``s`` lives on rank ``s % pp`` (with
``virtual_stages = v`` a rank holds stages ``r, r + pp, …, r + (v-1)·pp``, Megatron's
"interleaved" placement), or on ``placement[s]`` (the V shape: 0 1 … p-1 p-1 … 1 0).
Kinds: ``gpipe``, ``1f1b``, ``interleaved`` (v ≥ 2) and ``v`` (V-shaped 1F1B, v = 2). :meth:`PipelineSchedule.lower` inserts the point-to-point actions:

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

:func:`simulate` (in ``planner.schedule_sim``, re-exported here) runs the lowered lists in one process, with sends that do not block and receives
that wait for their message, exactly as the executor does. It raises :class:`ScheduleError` on a
deadlock (naming what each rank waits for), on a receive that no send matches, on a missing or
duplicated action, and on send/receive shapes that disagree. It returns a :class:`Timeline`, the
start and end of every action for given per-stage costs; its ``bubble`` is the measured idle
fraction that the planner's formula (:func:`predicted_bubble`) approximates.

Usage::

    sched = build_schedule("1f1b", pp=4, microbatches=8)
    print(sched.format())                       # one row of tokens per rank
    tl = simulate(sched.lower(), f_cost=1, b_cost=2)
    print(tl.format_gantt()); tl.bubble         # 3 / 11 for GPipe and 1F1B
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field
from typing import Any

from planner.plan import Plan

__all__ = [
    "Action", "PipelineSchedule", "ScheduleError", "Timeline", "Slot", "build_schedule", "schedule_for", "gpipe",
    "one_f_one_b", "interleaved_1f1b", "v_shape", "v_shape_timed", "simulate", "predicted_bubble", "parse_actions", "fifo_violations",
    "KINDS",
]

KINDS = ("gpipe", "1f1b", "interleaved", "v")
COMPUTE = ("F", "B")
COMM = ("SF", "RF", "SB", "RB")
_TOKEN = re.compile(r"^(SF|RF|SB|RB|F|B)(\d+)(?:@(\d+))?$")


class ScheduleError(ValueError):
    """A schedule that cannot run: deadlock, unmatched send/recv, bad shape, or a missing action."""


@dataclass(frozen=True, order=True)
class Action:
    """One step of a rank's program: ``kind`` of microbatch ``mb`` on stage ``stage``."""

    kind: str
    """F, B (compute) or SF, RF, SB, RB (send/recv of activations or gradients; see module doc)."""
    mb: int
    """Microbatch index."""
    stage: int
    """The stage (virtual stage when interleaved) the action belongs to."""

    def token(self, *, with_stage: bool = True) -> str:
        return f"{self.kind}{self.mb}@{self.stage}" if with_stage else f"{self.kind}{self.mb}"

    def __str__(self) -> str:
        return self.token()


def parse_actions(text: str, *, stage: int | None = None) -> list[Action]:
    """Parse ``"F0 F1 B0 RF2@1"``; tokens without ``@stage`` take ``stage`` (required then)."""
    out = []
    for tok in text.split():
        m = _TOKEN.match(tok)
        if m is None:
            raise ScheduleError(f"bad action token {tok!r}; expected e.g. F0, B3, SF2, RB1, or F0@2")
        if m.group(3) is None and stage is None:
            raise ScheduleError(f"token {tok!r} has no @stage and no default stage was given")
        out.append(Action(m.group(1), int(m.group(2)), int(m.group(3)) if m.group(3) else int(stage or 0)))
    return out


@dataclass(kw_only=True)
class PipelineSchedule:
    """Per-rank action lists of one training step. Pure data: print it, check it, then run it."""

    kind: str
    """gpipe, 1f1b, interleaved, or custom (built from text)."""
    pp: int
    """Number of pipeline ranks."""
    stages: int
    """Number of (virtual) stages; stage ``s`` runs on rank ``placement[s]`` (default ``s % pp``)."""
    microbatches: int
    """Microbatches per step."""
    actions: list[list[Action]] = field(default_factory=list)
    """``actions[r]`` is rank r's program, in order."""
    placement: list[int] | None = None
    """Stage -> rank; None is the looped placement ``s % pp`` (V-shape: 0 1 … p-1 p-1 … 1 0)."""

    @property
    def virtual_stages(self) -> int:
        return self.stages // self.pp

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that holds ``stage``."""
        return self.placement[stage] if self.placement is not None else stage % self.pp

    def rank_stages(self, rank: int) -> list[int]:
        """Stages held by ``rank`` in order."""
        return [s for s in range(self.stages) if self.stage_rank(s) == rank]

    def _with(self, actions: list[list[Action]], kind: str | None = None) -> PipelineSchedule:
        return PipelineSchedule(kind=kind or self.kind, pp=self.pp, stages=self.stages,
                                microbatches=self.microbatches, actions=actions, placement=self.placement)

    @property
    def lowered(self) -> bool:
        return any(a.kind in COMM for acts in self.actions for a in acts)

    def lower(self) -> PipelineSchedule:
        """Insert the send/recv actions: a receive right before the compute that needs it, a send
        right after the compute that produced it. Boundaries between two stages of the same rank
        stay local (no communication)."""
        if self.lowered:
            return self
        out: list[list[Action]] = []
        last = self.stages - 1
        for r, acts in enumerate(self.actions):
            prog: list[Action] = []
            for a in acts:
                s = a.stage
                if a.kind == "F":
                    if s > 0 and self.stage_rank(s - 1) != r:
                        prog.append(Action("RF", a.mb, s))
                    prog.append(a)
                    if s < last and self.stage_rank(s + 1) != r:
                        prog.append(Action("SF", a.mb, s))
                elif a.kind == "B":
                    if s < last and self.stage_rank(s + 1) != r:
                        prog.append(Action("RB", a.mb, s))
                    prog.append(a)
                    if s > 0 and self.stage_rank(s - 1) != r:
                        prog.append(Action("SB", a.mb, s))
                else:
                    prog.append(a)
            out.append(prog)
        return self._with(out)

    def forward_only(self) -> PipelineSchedule:
        """The forwards alone, microbatch-major on each rank (for evaluation): every forward waits
        only on forwards of smaller (microbatch, stage), so this order cannot deadlock."""
        acts = [[Action("F", mb, s) for mb in range(self.microbatches) for s in self.rank_stages(r)]
                for r in range(self.pp)]
        return self._with(acts, kind="forward")

    def compute_only(self) -> PipelineSchedule:
        return self._with([[a for a in acts if a.kind in COMPUTE] for acts in self.actions])

    # --- text ------------------------------------------------------------------------------------

    def rank_text(self, rank: int) -> str:
        """Rank ``rank``'s program as tokens (``@stage`` only when the rank holds several stages)."""
        short = self.virtual_stages == 1
        return " ".join(a.token(with_stage=not short) for a in self.actions[rank])

    def to_text(self) -> str:
        """One line per rank, ``rank R: tokens``; :meth:`from_text` reads it back."""
        return "\n".join(f"rank {r}: {self.rank_text(r)}" for r in range(self.pp)) + "\n"

    @classmethod
    def from_text(cls, text: str, *, stages: int | None = None, microbatches: int | None = None,
                  kind: str = "custom") -> PipelineSchedule:
        """Read :meth:`to_text` output (or a hand-written schedule) back; checks nothing, run
        :func:`simulate` on the result."""
        rows = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        pp = len(rows)
        actions: list[list[Action]] = []
        for r, row in enumerate(rows):
            head, sep, body = row.partition(":")
            if not sep or head.strip() != f"rank {r}":
                raise ScheduleError(f"line {r + 1} must start with 'rank {r}:', got {row[:20]!r}")
            actions.append(parse_actions(body, stage=r))
        n_stages = stages or max((a.stage for acts in actions for a in acts), default=0) + 1
        n_mb = microbatches or max((a.mb for acts in actions for a in acts), default=0) + 1
        # placement: the rank whose compute actions name the stage (looped when that is what they say)
        seen = {a.stage: r for r, acts in enumerate(actions) for a in acts if a.kind in COMPUTE}
        placement = [seen.get(st, st % pp) for st in range(n_stages)]
        looped = all(r == st % pp for st, r in enumerate(placement))
        return cls(kind=kind, pp=pp, stages=n_stages, microbatches=n_mb, actions=actions,
                   placement=None if looped else placement)

    def format(self) -> str:
        """A grid: one row per rank, one column per program step, tokens aligned."""
        short = self.virtual_stages == 1
        cells = [[a.token(with_stage=not short) for a in acts] for acts in self.actions]
        width = max((len(c) for row in cells for c in row), default=1)
        lines = [f"{self.kind}: pp={self.pp} stages={self.stages} microbatches={self.microbatches}"]
        for r, row in enumerate(cells):
            lines.append(f"rank {r} | " + " ".join(c.ljust(width) for c in row).rstrip())
        return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# schedule builders


def gpipe(pp: int, microbatches: int) -> PipelineSchedule:
    """GPipe (Huang et al. 2019): all forwards, then all backwards, on each rank."""
    _check_sizes(pp, microbatches, 1)
    acts = [[Action("F", i, r) for i in range(microbatches)] + [Action("B", i, r) for i in range(microbatches)]
            for r in range(pp)]
    return PipelineSchedule(kind="gpipe", pp=pp, stages=pp, microbatches=microbatches, actions=acts)


def one_f_one_b(pp: int, microbatches: int) -> PipelineSchedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021, section 2.2): rank r runs ``pp - r - 1``
    warm-up forwards, then alternates one forward and one backward, then drains the backwards.
    At most ``pp - r`` microbatches are in flight on rank r, against ``microbatches`` in GPipe."""
    _check_sizes(pp, microbatches, 1)
    acts = []
    for r in range(pp):
        warm = min(pp - r - 1, microbatches)
        prog = [Action("F", i, r) for i in range(warm)]
        for i in range(microbatches - warm):
            prog += [Action("F", warm + i, r), Action("B", i, r)]
        prog += [Action("B", i, r) for i in range(microbatches - warm, microbatches)]
        acts.append(prog)
    return PipelineSchedule(kind="1f1b", pp=pp, stages=pp, microbatches=microbatches, actions=acts)


def interleaved_1f1b(pp: int, microbatches: int, virtual_stages: int) -> PipelineSchedule:
    """Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
    GPU Clusters Using Megatron-LM", section 2.2.2): each rank holds ``v`` model chunks (stages
    ``r, r+pp, …``). Forwards go through the chunks in groups of ``pp`` microbatches; rank r runs
    ``2(pp - r - 1) + (v - 1)·pp`` warm-up forwards, then 1F1B. The bubble shrinks by ``v``."""
    v = virtual_stages
    _check_sizes(pp, microbatches, v)
    if v < 2:
        raise ScheduleError(f"interleaved needs virtual_stages >= 2 (got {v}); use '1f1b' for one stage per rank")
    if microbatches % pp:
        raise ScheduleError(f"interleaved 1F1B needs microbatches ({microbatches}) to be a multiple of "
                            f"pp ({pp}); use {microbatches + (-microbatches) % pp} microbatches or '1f1b'")
    total = microbatches * v

    def unit(k: int, *, backward: bool) -> tuple[int, int]:
        chunk = (k // pp) % v
        if backward:
            chunk = v - 1 - chunk
        return (k // (pp * v)) * pp + k % pp, chunk

    acts = []
    for r in range(pp):
        warm = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        fwd = [Action("F", mb, c * pp + r) for mb, c in (unit(k, backward=False) for k in range(total))]
        bwd = [Action("B", mb, c * pp + r) for mb, c in (unit(k, backward=True) for k in range(total))]
        prog = fwd[:warm]
        for i in range(total - warm):
            prog += [fwd[warm + i], bwd[i]]
        prog += bwd[total - warm:]
        acts.append(prog)
    return PipelineSchedule(kind="interleaved", pp=pp, stages=pp * v, microbatches=microbatches, actions=acts)


def v_shape(pp: int, microbatches: int) -> PipelineSchedule:
    """V-shaped 1F1B: two chunks per rank placed down and back up (stage s on rank s for s < pp,
    on rank 2·pp-1-s after), as in the V schedules of Qi et al. 2024 ("Pipeline Parallelism with
    Controllable Memory") without their weight-gradient split. Rank 0 holds the first and the last
    stage, so a tied embedding and LM head share a rank.

    The order is built by list scheduling with F = 1 and B = 2 per chunk: whenever a rank is free,
    it runs the ready action that can start earliest, a backward before a forward, and a new
    microbatch enters stage 0 only while fewer than ``2·pp`` are in flight there (chunks are half
    a 1F1B stage, so that is about 1F1B's peak memory on rank 0). Every stage runs its
    microbatches in order, so gradients accumulate in the same order as 1F1B. With F = 1, B = 2
    the bubble lies between 1F1B's and interleaved's (pp = 4, m = 8: 0.20 against 0.27 and 0.16).
    Messages between two ranks are not always received in the order they are sent, which the
    executor's tagged point-to-point handles (``fifo_violations`` lists them for untagged backends)."""
    return v_shape_timed(pp, microbatches)[0]


def v_shape_timed(pp: int, microbatches: int) -> tuple[PipelineSchedule, float]:
    """:func:`v_shape` and its makespan with F = 1, B = 2 per chunk and free communication (the
    list scheduler's own timeline; what ``planner.schedule_sim.simulate`` gives for it)."""
    _check_sizes(pp, microbatches, 1)
    stages = 2 * pp
    placement = [s if s < pp else 2 * pp - 1 - s for s in range(stages)]
    return _list_schedule("v", pp, microbatches, placement, cap=2 * pp)


def _list_schedule(kind: str, pp: int, m: int, placement: list[int], *,
                   cap: int) -> tuple[PipelineSchedule, float]:
    """Greedy list scheduling (F = 1, B = 2 per stage), at most ``cap`` microbatches in flight; see
    v_shape. Returns the schedule and its makespan.

    Each step runs the action with the smallest (start, backward first, rank, stage). Every stage
    offers one candidate (its next backward or forward, whichever sorts first), kept in a heap;
    running an action changes only the candidates of its rank's stages (the rank is busy longer) and
    of its stage and the two next to it (dependencies, and stage 0's in-flight cap), so only those
    are recomputed: O(actions · log stages) instead of a scan of every stage per action."""
    stages = len(placement)
    last = stages - 1
    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    next_f = [0] * stages  # next microbatch each stage forwards / backwards (in order)
    next_b = [0] * stages
    free = [0.0] * pp
    acts: list[list[Action]] = [[] for _ in range(pp)]
    on_rank = [[s for s in range(stages) if placement[s] == r] for r in range(pp)]
    Candidate = tuple[float, int, int, int, str]  # (start, B-first, rank, stage, kind)

    def candidate(s: int) -> Candidate | None:
        r, best = placement[s], None
        mb = next_b[s]
        if mb < m and (mb, s) in f_end and (s == last or (mb, s + 1) in b_end):
            best = (max(free[r], f_end[(mb, s)], b_end.get((mb, s + 1), 0.0)), 0, r, s, "B")
        mb = next_f[s]
        if mb < m and (s > 0 or next_f[0] - next_b[0] < cap) and (s == 0 or (mb, s - 1) in f_end):
            cand = (max(free[r], f_end.get((mb, s - 1), 0.0)), 1, r, s, "F")
            best = cand if best is None or cand < best else best
        return best

    current = [candidate(s) for s in range(stages)]
    heap = [c for c in current if c is not None]
    heapq.heapify(heap)
    for _ in range(2 * m * stages):
        while heap and current[heap[0][3]] != heap[0]:
            heapq.heappop(heap)  # superseded by a recomputed candidate of its stage
        if not heap:
            raise ScheduleError(f"list scheduling of {kind} found no runnable action")
        start, _, r, s, k = heapq.heappop(heap)
        if k == "F":
            f_end[(next_f[s], s)] = start + 1.0
            acts[r].append(Action("F", next_f[s], s))
            next_f[s] += 1
            free[r] = start + 1.0
        else:
            b_end[(next_b[s], s)] = start + 2.0
            acts[r].append(Action("B", next_b[s], s))
            next_b[s] += 1
            free[r] = start + 2.0
        current[s] = None
        for t in {*on_rank[r], s - 1, s, s + 1}:
            if 0 <= t < stages:
                cand = candidate(t)
                if cand != current[t]:
                    current[t] = cand
                    if cand is not None:
                        heapq.heappush(heap, cand)
    sched = PipelineSchedule(kind=kind, pp=pp, stages=stages, microbatches=m, actions=acts, placement=placement)
    return sched, max(free)


def build_schedule(kind: str, *, pp: int, microbatches: int, virtual_stages: int = 1) -> PipelineSchedule:
    """The schedule ``kind`` (gpipe, 1f1b, interleaved) for ``pp`` ranks; the plan's
    ``schedule`` block maps onto these arguments one to one."""
    if kind == "gpipe" or kind == "1f1b":
        if virtual_stages != 1:
            raise ScheduleError(f"{kind} runs one stage per rank, but virtual_stages={virtual_stages}; "
                                "use kind 'interleaved' for several stages per rank")
        return gpipe(pp, microbatches) if kind == "gpipe" else one_f_one_b(pp, microbatches)
    if kind == "interleaved":
        return interleaved_1f1b(pp, microbatches, virtual_stages)
    if kind == "v":
        if virtual_stages != 2:
            raise ScheduleError(f"v places two stages on each rank; set virtual_stages=2 (got {virtual_stages})")
        return v_shape(pp, microbatches)
    raise ScheduleError(f"unknown schedule kind {kind!r}; choose from {', '.join(KINDS)}")


def schedule_for(plan: Plan) -> PipelineSchedule:
    """The schedule a plan asks for: ``plan.schedule`` (kind, microbatches, virtual_stages) on
    ``plan.mesh.pp`` ranks."""
    return build_schedule(plan.schedule.kind, pp=plan.mesh.pp, microbatches=plan.schedule.microbatches,
                          virtual_stages=plan.schedule.virtual_stages)


def _check_sizes(pp: int, microbatches: int, v: int) -> None:
    if pp < 1 or microbatches < 1 or v < 1:
        raise ScheduleError(f"pp ({pp}), microbatches ({microbatches}) and virtual_stages ({v}) must be >= 1")


def predicted_bubble(kind: str, *, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of the step with equal stage costs: ``(p-1)/(m+p-1)`` for GPipe and 1F1B
    (Huang et al. 2019, section 2.3), and ``(p-1)/(v·m+p-1)`` for interleaved, whose bubble time is
    ``(p-1)/v`` of a microbatch's compute (Narayanan et al. 2021, section 2.2.2). The list-scheduled
    ``v`` has no closed form: its simulated timeline at F = 1, B = 2 per stage gives it."""
    if kind == "v":
        from planner.schedule_sim import simulate

        return simulate(v_shape(pp, microbatches)).bubble
    p, m, v = pp, microbatches, virtual_stages if kind == "interleaved" else 1
    return (p - 1) / (v * m + p - 1)


_SIM_NAMES = ("simulate", "Timeline", "Slot", "fifo_violations")


def __getattr__(name: str) -> Any:
    """The checker and timeline live in ``planner.schedule_sim`` and are part of this module's API
    (resolved lazily: that module imports this one)."""
    if name in _SIM_NAMES:
        from planner import schedule_sim

        return getattr(schedule_sim, name)
    raise AttributeError(f"module 'planner.schedule' has no attribute {name!r}")
