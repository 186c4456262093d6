"""Schedules as data: golden grids, the simulator's checks, and the bubble it measures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from planner.schedule import (Action, PipelineSchedule, ScheduleError, build_schedule, check_nccl_order, parse_actions,
                              predicted_bubble, simulate)

GOLDEN = Path(__file__).parent / "golden"
CONFIGS = [(k, p, m, 1) for k in ("gpipe", "1f1b") for p in (2, 4) for m in (p, 2 * p)]
CONFIGS += [(k, p, m, 2) for k in ("interleaved", "v") for p in (2, 4) for m in (p, 2 * p)]


def _name(kind: str, pp: int, m: int, v: int) -> str:
    return f"{kind}_pp{pp}_m{m}" + (f"_v{v}" if v > 1 else "") + ".txt"


def _render(kind: str, pp: int, m: int, v: int) -> str:
    sched = build_schedule(kind, pp=pp, microbatches=m, virtual_stages=v)
    tl = simulate(sched, f_cost=1.0, b_cost=2.0)
    return (sched.format() + "\n# lowered\n" + sched.lower().to_text()
            + "\n# timeline (F = 1, B = 2)\n" + tl.format_gantt(unit=1.0)
            + "\n# batched point-to-point (NCCL order)\n" + check_nccl_order(sched).to_text())


@pytest.mark.parametrize("kind,pp,m,v", CONFIGS)
def test_golden_grid(kind: str, pp: int, m: int, v: int) -> None:
    path = GOLDEN / _name(kind, pp, m, v)
    text = _render(kind, pp, m, v)
    if os.environ.get("FS_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with FS_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text()


def test_1f1b_grid_by_hand() -> None:
    # Narayanan et al. 2021, figure 4 (top), pp = 4, m = 8: rank r warms up with pp - r - 1 forwards.
    sched = build_schedule("1f1b", pp=4, microbatches=8)
    assert sched.rank_text(0) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert sched.rank_text(3) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    assert sched.lower().rank_text(1).startswith("RF0 F0 SF0 RF1 F1 SF1 RF2 F2 SF2 RB0 B0 SB0 RF3 F3")


@pytest.mark.parametrize("kind,pp,m,v", CONFIGS + [("interleaved", 4, 8, 4), ("interleaved", 2, 6, 3)])
def test_simulated_bubble_matches_formula(kind: str, pp: int, m: int, v: int) -> None:
    sched = build_schedule(kind, pp=pp, microbatches=m, virtual_stages=v)
    tl = simulate(sched, f_cost=1.0 / v, b_cost=2.0 / v)
    assert tl.bubble == pytest.approx(predicted_bubble(kind, pp=pp, microbatches=m, virtual_stages=v))
    check_nccl_order(sched)  # the executor's batched order: matched in order, no deadlock under NCCL
    check_nccl_order(sched.forward_only())
    # every rank runs each of its (microbatch, stage) pairs once forward and once backward
    for r in range(pp):
        comp = [a for a in sched.actions[r]]
        assert len(comp) == 2 * m * v
        assert {a.stage for a in comp} == set(sched.rank_stages(r)) and len(sched.rank_stages(r)) == v


def test_1f1b_keeps_fewer_microbatches_in_flight_than_gpipe() -> None:
    def peak(sched: PipelineSchedule, r: int) -> int:
        live = best = 0
        for a in sched.actions[r]:
            live += 1 if a.kind == "F" else -1
            best = max(best, live)
        return best

    g, o = build_schedule("gpipe", pp=4, microbatches=8), build_schedule("1f1b", pp=4, microbatches=8)
    assert [peak(g, r) for r in range(4)] == [8, 8, 8, 8]
    assert [peak(o, r) for r in range(4)] == [4, 3, 2, 1]


def test_v_shape_places_first_and_last_stage_on_rank_0() -> None:
    sched = build_schedule("v", pp=4, microbatches=8, virtual_stages=2)
    assert [sched.stage_rank(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert sched.rank_stages(0) == [0, 7]
    bubbles = {k: simulate(build_schedule(k, pp=4, microbatches=8, virtual_stages=2 if k != "1f1b" else 1),
                           f_cost=1.0 / (2 if k != "1f1b" else 1), b_cost=2.0 / (2 if k != "1f1b" else 1)).bubble
               for k in ("1f1b", "interleaved", "v")}
    assert bubbles["interleaved"] < bubbles["v"] < bubbles["1f1b"]
    # every stage runs its microbatches in order, forward and backward
    for r in range(4):
        for s in sched.rank_stages(r):
            for kind in "FB":
                assert [a.mb for a in sched.actions[r] if a.kind == kind and a.stage == s] == list(range(8))
    with pytest.raises(ScheduleError, match='kind "v" places two chunks on each pipeline rank'):
        build_schedule("v", pp=2, microbatches=2)


def test_text_round_trip() -> None:
    for kind, pp, m, v in CONFIGS:
        sched = build_schedule(kind, pp=pp, microbatches=m, virtual_stages=v).lower()
        back = PipelineSchedule.from_text(sched.to_text(), stages=pp * v, microbatches=m)
        assert back.actions == sched.actions
        assert [back.stage_rank(s) for s in range(pp * v)] == [sched.stage_rank(s) for s in range(pp * v)]
    assert parse_actions("F0 RB1@3", stage=2) == [Action("F", 0, 2), Action("RB", 1, 3)]


def test_uneven_costs_shift_the_timeline() -> None:
    tl = simulate(build_schedule("gpipe", pp=2, microbatches=2), f_cost=[1.0, 3.0], b_cost=[1.0, 3.0])
    starts = {(s.rank, str(s.action)): (s.start, s.end) for s in tl.slots}
    assert starts[(1, "F0@1")] == (1.0, 4.0)
    assert starts[(1, "F1@1")] == (4.0, 7.0)
    assert starts[(0, "B0@0")] == (10.0, 11.0)   # waits for B0 on stage 1 (7 -> 10)
    assert tl.makespan == 14.0


def test_deadlock_is_reported_with_what_each_rank_waits_for() -> None:
    bad = PipelineSchedule.from_text("rank 0: F0 RB0 B0 SF0\nrank 1: RF0 F0 B0 SB0\n")
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits at RB0@0 for SB0@1 from rank 1; "
                                            r"rank 1 waits at RF0@1 for SF0@0 from rank 0"):
        simulate(bad)


def test_unmatched_send_and_missing_actions() -> None:
    extra = PipelineSchedule.from_text("rank 0: F0 SF0 SF0 RB0 B0\nrank 1: RF0 F0 B0 SB0\n")
    with pytest.raises(ScheduleError, match="SF0@0 appears twice"):
        simulate(extra)
    missing = PipelineSchedule.from_text("rank 0: F0 SF0 F1 SF1 RB0 B0\nrank 1: RF0 F0 B0 SB0 RF1 F1 B1 SB1\n")
    with pytest.raises(ScheduleError, match=r"1 compute action\(s\) missing, e.g. B1@0"):
        simulate(missing)
    lost = PipelineSchedule.from_text("rank 0: F0 SF0 B0\nrank 1: RF0 F0 B0 SB0\n")
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits at B0@0 for F0@0 and the gradient "
                                            r"from stage 1"):
        simulate(lost)
    edge = PipelineSchedule.from_text("rank 0: F0 SF0 RB0 B0\nrank 1: RF0 F0 SF0 B0 SB0\n")
    with pytest.raises(ScheduleError, match="rank 1: SF0@1 sends past the last stage"):
        simulate(edge)
    wrong = PipelineSchedule.from_text("rank 0: F0@1\nrank 1: F0@1\n")
    with pytest.raises(ScheduleError, match="rank 0: F0@1 belongs to stage 1, held by rank 1"):
        simulate(wrong)


def test_shape_specs_must_agree() -> None:
    sched = build_schedule("1f1b", pp=2, microbatches=2)
    ok = {0: [((2, 16, 64), "float32")]}
    simulate(sched, send_specs=ok, recv_specs={1: [((2, 16, 64), "float32")]})
    with pytest.raises(ScheduleError, match=r"stage 0 sends \[\(\(2, 16, 64\), 'float32'\)\] but stage 1 "
                                            r"expects \[\(\(4, 16, 64\), 'float32'\)\]"):
        simulate(sched, send_specs=ok, recv_specs={1: [((4, 16, 64), "float32")]})


def test_bad_arguments_say_what_to_do() -> None:
    with pytest.raises(ScheduleError, match=r"needs a multiple of 4; 6 % 4 = 2 \(use 8\)"):
        build_schedule("interleaved", pp=4, microbatches=6, virtual_stages=2)
    with pytest.raises(ScheduleError, match='"interleaved" places 2 or more model chunks on each pipeline rank'):
        build_schedule("interleaved", pp=2, microbatches=2)
    with pytest.raises(ScheduleError, match='need kind "interleaved", but schedule.kind is "1f1b"'):
        build_schedule("1f1b", pp=2, microbatches=2, virtual_stages=2)
    with pytest.raises(ScheduleError, match="unknown schedule kind 'zb'"):
        build_schedule("zb", pp=2, microbatches=2)
    with pytest.raises(ScheduleError, match="bad action token 'X1'"):
        parse_actions("F0 X1", stage=0)


@pytest.mark.parametrize("kind,pp,m,v", CONFIGS)
def test_forward_only_schedule_runs_every_forward_once(kind: str, pp: int, m: int, v: int) -> None:
    fwd = build_schedule(kind, pp=pp, microbatches=m, virtual_stages=v).forward_only()
    tl = simulate(fwd, f_cost=1.0)
    assert sorted((s.action.mb, s.action.stage) for s in tl.slots) == [(i, s) for i in range(m) for s in range(pp * v)]
    if v == 1:  # microbatch-major forwards fill the pipeline once: m + p - 1 forward times
        assert tl.makespan == m + pp - 1
