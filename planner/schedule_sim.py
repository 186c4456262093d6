"""The single-process checker of pipeline schedules, and the timeline it computes.

:func:`simulate` runs every rank's lowered action list (``planner.schedule``) the way the executor
does: sends never block, a receive waits for its message. It raises ``ScheduleError`` on a
deadlock, an unmatched or duplicated message, a missing compute action, or boundary shapes that
disagree, and returns a :class:`Timeline`: start and end of every F and B for given per-stage
costs, the makespan, and the bubble (idle fraction) that the planner's closed form approximates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from planner.schedule_ir import COMPUTE, Action, PipelineSchedule, ScheduleError

__all__ = ["simulate", "Timeline", "Slot"]


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

    def to_rows(self) -> list[dict[str, Any]]:
        """One dict per compute action (rank, stage, microbatch, kind, start, end): for reports."""
        return [{"rank": s.rank, "stage": s.action.stage, "mb": s.action.mb, "kind": s.action.kind,
                 "start": s.start, "end": s.end} for s in self.slots]

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
    kinds = COMPUTE if any(k == "B" for k, _, _ in seen) else ("F",)  # a forward-only schedule has no B
    missing = [f"{k}{mb}@{s}" for s in range(sched.stages) for mb in range(sched.microbatches)
               for k in kinds if (k, mb, s) not in seen]
    if missing:
        raise ScheduleError(f"{len(missing)} compute action(s) missing, e.g. {', '.join(missing[:4])}")


def _check_specs(sched: PipelineSchedule, send_specs: Specs, recv_specs: Specs) -> None:
    for s in range(sched.stages - 1):
        out, inp = list(send_specs.get(s, [])), list(recv_specs.get(s + 1, []))
        if out != inp:
            raise ScheduleError(f"stage {s} sends {out} but stage {s + 1} expects {inp}")
