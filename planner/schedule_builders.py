"""The action lists of each schedule kind: GPipe, 1F1B, interleaved 1F1B, and the list-scheduled V.

Each builder returns a :class:`planner.schedule_ir.PipelineSchedule`; ``planner.schedule_kinds``
says which builder a plan's ``schedule.kind`` uses and with what arguments.
"""

from __future__ import annotations

import heapq

from planner.schedule_ir import Action, PipelineSchedule, ScheduleError

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "v_shape", "v_shape_timed", "v_placement", "check_sizes"]


def gpipe(pp: int, microbatches: int) -> PipelineSchedule:
    """GPipe (Huang et al. 2019): all forwards, then all backwards, on each rank."""
    check_sizes(pp, microbatches, 1)
    acts = [[Action("F", i, r) for i in range(microbatches)] + [Action("B", i, r) for i in range(microbatches)]
            for r in range(pp)]
    return PipelineSchedule(kind="gpipe", pp=pp, stages=pp, microbatches=microbatches, actions=acts)


def one_f_one_b(pp: int, microbatches: int) -> PipelineSchedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021, section 2.2): rank r runs ``pp - r - 1``
    warm-up forwards, then alternates one forward and one backward, then drains the backwards.
    At most ``pp - r`` microbatches are in flight on rank r, against ``microbatches`` in GPipe."""
    check_sizes(pp, microbatches, 1)
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
    ``2(pp - r - 1) + (v - 1)·pp`` warm-up forwards, then 1F1B. The bubble shrinks by ``v``.
    Needs ``v >= 2`` and ``pp | microbatches`` (``planner.schedule_kinds`` checks them)."""
    v = virtual_stages
    check_sizes(pp, microbatches, v)
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
    In :meth:`PipelineSchedule.lower`'s order the messages between two ranks are not always received
    in the order they are sent; the executor runs the batched order of ``planner.schedule_batched``,
    which matches them in order (as NCCL needs)."""
    return v_shape_timed(pp, microbatches)[0]


def v_shape_timed(pp: int, microbatches: int) -> tuple[PipelineSchedule, float]:
    """:func:`v_shape` and its makespan with F = 1, B = 2 per chunk and free communication (the
    list scheduler's own timeline; what ``planner.schedule_sim.simulate`` gives for it)."""
    check_sizes(pp, microbatches, 1)
    return _list_schedule("v", pp, microbatches, v_placement(pp), cap=2 * pp)


def v_placement(pp: int) -> list[int]:
    """The V shape's stage -> rank map: down and back up, ``0 1 … p-1 p-1 … 1 0``."""
    return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]


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


def check_sizes(pp: int, microbatches: int, v: int) -> None:
    if pp < 1 or microbatches < 1 or v < 1:
        raise ScheduleError(f"pp ({pp}), microbatches ({microbatches}) and virtual_stages ({v}) must be >= 1")
