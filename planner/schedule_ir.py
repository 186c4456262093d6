"""Pipeline schedules as data: an :class:`Action` per step of a rank's program, a
:class:`PipelineSchedule` of per-rank action lists, their text form, and the lowering that inserts
point-to-point actions. The builders of each kind live in ``planner.schedule_builders``, the kinds
in ``planner.schedule_kinds``, the checker and timeline in ``planner.schedule_sim``; see
``planner.schedule`` for the tokens and a picture.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["Action", "PipelineSchedule", "ScheduleError", "parse_actions", "COMPUTE", "COMM"]

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
