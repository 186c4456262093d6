"""Pipeline schedules as data: per-rank action lists, their text form, a checker and a timeline.

A schedule says, for every pipeline rank, in which order it runs the forward (``F``) and backward
(``B``) of each microbatch on each of its stages. Stage ``s`` lives on rank ``s % pp`` (with
``virtual_stages = v`` a rank holds stages ``r, r + pp, …, r + (v-1)·pp``, Megatron's
"interleaved" placement). :meth:`PipelineSchedule.lower` inserts the point-to-point actions:

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

:func:`simulate` runs the lowered lists in one process, with sends that do not block and receives
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

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from planner.plan import Plan

__all__ = [
    "Action", "PipelineSchedule", "ScheduleError", "Timeline", "Slot", "build_schedule", "schedule_for", "gpipe",
    "one_f_one_b", "interleaved_1f1b", "simulate", "predicted_bubble", "parse_actions", "fifo_violations",
    "KINDS",
]

KINDS = ("gpipe", "1f1b", "interleaved")
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
    """Number of (virtual) stages; stage ``s`` runs on rank ``s % pp``."""
    microbatches: int
    """Microbatches per step."""
    actions: list[list[Action]] = field(default_factory=list)
    """``actions[r]`` is rank r's program, in order."""

    @property
    def virtual_stages(self) -> int:
        return self.stages // self.pp

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that holds ``stage``."""
        return stage % self.pp

    def rank_stages(self, rank: int) -> list[int]:
        """Stages held by ``rank`` in order."""
        return list(range(rank, self.stages, self.pp))

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
        return PipelineSchedule(kind=self.kind, pp=self.pp, stages=self.stages,
                                microbatches=self.microbatches, actions=out)

    def compute_only(self) -> PipelineSchedule:
        return PipelineSchedule(kind=self.kind, pp=self.pp, stages=self.stages, microbatches=self.microbatches,
                                actions=[[a for a in acts if a.kind in COMPUTE] for acts in self.actions])

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
        return cls(kind=kind, pp=pp, stages=n_stages, microbatches=n_mb, actions=actions)

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
    ``(p-1)/v`` of a microbatch's compute (Narayanan et al. 2021, section 2.2.2)."""
    p, m, v = pp, microbatches, virtual_stages if kind == "interleaved" else 1
    return (p - 1) / (v * m + p - 1)


# ------------------------------------------------------------------------------------------------
# the checker and timeline


@dataclass(frozen=True)
class Slot:
    """One compute action placed on the timeline."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """What :func:`simulate` computed: every compute action's start and end per rank."""

    pp: int
    slots: list[Slot]
    makespan: float

    def busy(self, rank: int) -> float:
        return sum(s.end - s.start for s in self.slots if s.rank == rank)

    @property
    def bubble(self) -> float:
        """Idle fraction: 1 - (busy time of all ranks) / (ranks × makespan)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(self.pp)) / (self.pp * self.makespan)

    def format_gantt(self, *, unit: float | None = None) -> str:
        """ASCII Gantt chart: one row per rank, one column per ``unit`` of time ('.' = idle)."""
        if unit is None:
            unit = min((s.end - s.start for s in self.slots if s.end > s.start), default=1.0)
        columns = max(1, int(round(self.makespan / unit)))
        stages_per_rank = {r: {s.action.stage for s in self.slots if s.rank == r} for r in range(self.pp)}
        rows: list[list[str]] = [["."] * columns for _ in range(self.pp)]
        for s in self.slots:
            tok = s.action.token(with_stage=len(stages_per_rank[s.rank]) > 1)
            for c in range(int(round(s.start / unit)), int(round(s.end / unit))):
                rows[s.rank][c] = tok
        width = max((len(c) for row in rows for c in row), default=1)
        lines = [f"rank {r} | " + " ".join(c.ljust(width) for c in row).rstrip() for r, row in enumerate(rows)]
        lines.append(f"bubble {self.bubble:.4f}  makespan {self.makespan:g}")
        return "\n".join(lines) + "\n"


Specs = Mapping[int, Sequence[Any]]


def simulate(schedule: PipelineSchedule, *, f_cost: float | Sequence[float] = 1.0,
             b_cost: float | Sequence[float] = 2.0, comm_cost: float = 0.0,
             send_specs: Specs | None = None, recv_specs: Specs | None = None) -> Timeline:
    """Check ``schedule`` in one process and place every action in time.

    Sends never block; a receive waits until its matching send has run (matched by kind,
    microbatch and stage, as the executor's tagged point-to-point ops are). Costs are per stage
    (a sequence) or equal for all; ``comm_cost`` delays each message. ``send_specs[s]`` are the
    specs (e.g. (shape, dtype) pairs) stage ``s`` sends forward, ``recv_specs[s]`` what stage
    ``s`` expects to receive; they must agree at every boundary.

    Raises :class:`ScheduleError` on any problem; returns the :class:`Timeline`.
    """
    sched = schedule.lower()
    _check_coverage(sched)
    if send_specs is not None and recv_specs is not None:
        _check_specs(sched, send_specs, recv_specs)
    fc = _per_stage(f_cost, sched.stages, "f_cost")
    bc = _per_stage(b_cost, sched.stages, "b_cost")
    last = sched.stages - 1
    done: dict[tuple[str, int, int], float] = {}   # compute (kind, mb, stage) -> end time
    posted: dict[tuple[str, int, int], float] = {}  # message (SF|SB, mb, sending stage) -> arrival
    received: set[tuple[str, int, int]] = set()
    local: dict[tuple[str, int, int], float] = {}   # (RF|RB, mb, stage) completed -> time
    clock = [0.0] * sched.pp
    pc = [0] * sched.pp
    slots: list[Slot] = []

    def ready(r: int, a: Action) -> float | None:
        """Time at which ``a`` may start on rank r, or None if it is blocked."""
        deps: list[float] = [clock[r]]
        if a.kind == "F":
            if a.stage > 0:
                key = ("F", a.mb, a.stage - 1) if sched.stage_rank(a.stage - 1) == r else ("RF", a.mb, a.stage)
                t = done.get(key) if key[0] == "F" else local.get(key)
                if t is None:
                    return None
                deps.append(t)
        elif a.kind == "B":
            own = done.get(("F", a.mb, a.stage))
            if own is None:
                return None
            deps.append(own)
            if a.stage < last:
                key = ("B", a.mb, a.stage + 1) if sched.stage_rank(a.stage + 1) == r else ("RB", a.mb, a.stage)
                t = done.get(key) if key[0] == "B" else local.get(key)
                if t is None:
                    return None
                deps.append(t)
        elif a.kind in ("SF", "SB"):
            t = done.get(("F" if a.kind == "SF" else "B", a.mb, a.stage))
            if t is None:
                raise ScheduleError(f"rank {r} sends {a} before computing it")
            deps.append(t)
        else:  # RF / RB
            msg = ("SF", a.mb, a.stage - 1) if a.kind == "RF" else ("SB", a.mb, a.stage + 1)
            t = posted.get(msg)
            if t is None:
                return None
            deps.append(t)
        return max(deps)

    total = sum(len(p) for p in sched.actions)
    finished = 0
    while finished < total:
        progressed = False
        for r in range(sched.pp):
            while pc[r] < len(sched.actions[r]):
                a = sched.actions[r][pc[r]]
                start = ready(r, a)
                if start is None:
                    break
                if a.kind in COMPUTE:
                    end = start + (fc if a.kind == "F" else bc)[a.stage]
                    done[(a.kind, a.mb, a.stage)] = end
                    slots.append(Slot(r, a, start, end))
                    clock[r] = end
                elif a.kind in ("SF", "SB"):
                    posted[(a.kind, a.mb, a.stage)] = start + comm_cost
                    clock[r] = start
                else:
                    msg = ("SF", a.mb, a.stage - 1) if a.kind == "RF" else ("SB", a.mb, a.stage + 1)
                    if msg in received:
                        raise ScheduleError(f"rank {r}: {a} receives a message already received")
                    received.add(msg)
                    local[(a.kind, a.mb, a.stage)] = start
                    clock[r] = start
                pc[r] += 1
                finished += 1
                progressed = True
        if not progressed:
            raise ScheduleError("deadlock: " + "; ".join(
                _blocked(sched, r, sched.actions[r][pc[r]]) for r in range(sched.pp) if pc[r] < len(sched.actions[r])))
    unmatched = sorted(set(posted) - received)
    if unmatched:
        k, mb, s = unmatched[0]
        raise ScheduleError(f"{len(unmatched)} send(s) never received, first {k}{mb}@{s} from rank "
                            f"{sched.stage_rank(s)}")
    return Timeline(pp=sched.pp, slots=slots, makespan=max((s.end for s in slots), default=0.0))


def _blocked(sched: PipelineSchedule, r: int, a: Action) -> str:
    if a.kind == "RF":
        need = f"SF{a.mb}@{a.stage - 1} from rank {sched.stage_rank(a.stage - 1)}"
    elif a.kind == "RB":
        need = f"SB{a.mb}@{a.stage + 1} from rank {sched.stage_rank(a.stage + 1)}"
    elif a.kind == "F":
        need = f"the input of microbatch {a.mb} (F{a.mb}@{a.stage - 1} first)"
    else:
        need = f"F{a.mb}@{a.stage} and the gradient from stage {a.stage + 1}"
    return f"rank {r} waits at {a} for {need}"


def _per_stage(cost: float | Sequence[float], stages: int, name: str) -> list[float]:
    if isinstance(cost, (int, float)):
        return [float(cost)] * stages
    out = [float(c) for c in cost]
    if len(out) != stages:
        raise ScheduleError(f"{name} has {len(out)} entries but the schedule has {stages} stages")
    return out


def _check_coverage(sched: PipelineSchedule) -> None:
    if len(sched.actions) != sched.pp:
        raise ScheduleError(f"schedule has programs for {len(sched.actions)} ranks, but pp={sched.pp}")
    if sched.stages % sched.pp:
        raise ScheduleError(f"stages ({sched.stages}) must be a multiple of pp ({sched.pp})")
    seen: dict[tuple[str, int, int], int] = {}
    for r, acts in enumerate(sched.actions):
        for a in acts:
            if not (0 <= a.stage < sched.stages and 0 <= a.mb < sched.microbatches):
                raise ScheduleError(f"rank {r}: {a} is outside stages 0..{sched.stages - 1} / "
                                    f"microbatches 0..{sched.microbatches - 1}")
            if sched.stage_rank(a.stage) != r:
                raise ScheduleError(f"rank {r}: {a} belongs to stage {a.stage}, held by rank "
                                    f"{sched.stage_rank(a.stage)}")
            if a.kind in ("SF", "RB") and a.stage == sched.stages - 1:
                raise ScheduleError(f"rank {r}: {a} {'sends past' if a.kind == 'SF' else 'waits for'} the last stage")
            if a.kind in ("SB", "RF") and a.stage == 0:
                raise ScheduleError(f"rank {r}: {a} {'sends before' if a.kind == 'SB' else 'waits for'} the first stage")
            key = (a.kind, a.mb, a.stage)
            if key in seen:
                raise ScheduleError(f"rank {r}: {a} appears twice")
            seen[key] = r
    missing = [f"{k}{mb}@{s}" for s in range(sched.stages) for mb in range(sched.microbatches)
               for k in COMPUTE if (k, mb, s) not in seen]
    if missing:
        raise ScheduleError(f"{len(missing)} compute action(s) missing, e.g. {', '.join(missing[:4])}")


def _check_specs(sched: PipelineSchedule, send_specs: Specs, recv_specs: Specs) -> None:
    for s in range(sched.stages - 1):
        out, inp = list(send_specs.get(s, [])), list(recv_specs.get(s + 1, []))
        if out != inp:
            raise ScheduleError(f"stage {s} sends {out} but stage {s + 1} expects {inp}")


def fifo_violations(schedule: PipelineSchedule) -> list[str]:
    """Channels (sender rank → receiver rank) whose send order differs from the receive order.

    The executor tags every message, so gloo matches them in any order; a backend that ignores
    tags (NCCL) matches in order and needs this list to be empty."""
    sched = schedule.lower()
    sends: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    recvs: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for r, acts in enumerate(sched.actions):
        for a in acts:
            if a.kind == "SF" or a.kind == "SB":
                peer = sched.stage_rank(a.stage + (1 if a.kind == "SF" else -1))
                sends.setdefault((r, peer), []).append((a.kind, a.mb, a.stage))
            elif a.kind == "RF" or a.kind == "RB":
                src_stage = a.stage - 1 if a.kind == "RF" else a.stage + 1
                msg = ("SF" if a.kind == "RF" else "SB", a.mb, src_stage)
                recvs.setdefault((sched.stage_rank(src_stage), r), []).append(msg)
    out = []
    for ch in sorted(set(sends) | set(recvs)):
        if sends.get(ch, []) != recvs.get(ch, []):
            out.append(f"rank {ch[0]} → rank {ch[1]}")
    return out
