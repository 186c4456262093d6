"""The NCCL semantics checker catches, on gloo, the point-to-point that NCCL would hang or corrupt on.

Every pipeline run of the suite is under the checker (``tests/conftest.py`` sets
``FAIRSCALE_NCCL_CHECK=1``): every schedule kind at pp 2 and 4 with tied weights
(``test_pipeline.py``), and 3-D, TP/SP, EP plans on 8 ranks (``test_device_guard.py``,
``test_parallelize.py``). Here it is shown to fail, clearly, on what it exists to catch: the
executor's former order of one call per message (1F1B deadlocks under NCCL's rendezvous, the V
schedule's messages meet the wrong receives), a size mismatch that gloo itself would abort on
without a message, and the tied-weight exchange's former send-then-receive.
"""

from __future__ import annotations

import pytest
import torch

import fairscale.runtime as rt
from fairscale.runtime.mesh import build_mesh
from fairscale.runtime.nccl_check import NcclChecker, NcclSemanticsError
from fairscale.runtime.p2p import Message, exchange
from fairscale.runtime.pipeline import PipelineExecutor
from fairscale.testing.models import build
from passes.ops import comm
from passes.split_stages import split_stages_pass
from planner.capture import capture
from planner.plan import Mesh, Plan, Schedule, Stage
from planner.schedule import COMM, CommBatch, schedule_for

GB = 8


def _plan(graph, kind: str, m: int) -> Plan:
    v = 2 if kind == "v" else 1
    names = [layer.name for layer in graph.layers]
    n = 2 * v
    cuts = [round(i * len(names) / n) for i in range(n + 1)]
    return Plan(mesh=Mesh(pp=2), schedule=Schedule(kind=kind, microbatches=m, virtual_stages=v),
                stages=[Stage(layers=", ".join(names[cuts[i]:cuts[i + 1]])) for i in range(n)])


def _unbatched(rank: int, world: int, graph, kind: str, m: int) -> None:
    """Train one step with the executor posting one call per message in ``lower()``'s order."""
    mesh, _ = build_mesh(world, 1, 1)
    with mesh.groups.active():
        plan = _plan(graph, kind, m)
        pipe = PipelineExecutor(split_stages_pass(graph.gm, plan, graph=graph), schedule_for(plan), nccl_check=True)
        pipe.batched = [CommBatch(0.0, (a,)) if a.kind in COMM else a for a in pipe.schedule.lower().actions[rank]]
        pipe.step(build("gpt").make_batch(0, GB))


def _raw(rank: int, world: int, scenario: str) -> str:
    """Messages posted by hand through the checker, on a pipeline axis of two ranks."""
    mesh, _ = build_mesh(world, 1, 1)
    with mesh.groups.active():
        check = NcclChecker("pp")
        group, peer = comm.get_group("pp"), 1 - rank
        if scenario == "size":  # rank 0 sends 4 floats, rank 1 posts a receive of 2
            t = torch.ones(4) if rank == 0 else torch.empty(2)
            exchange([Message(rank == 0, peer, t, "x", "SF0@0" if rank == 0 else "RF0@1")], group=group, axis="pp",
                     check=check).wait()
            return "passed"
        # each side sends its gradient, then receives the other's, in separate calls (the tied-weight
        # exchange before batching)
        mine, theirs = torch.full((3,), float(rank)), torch.empty(3)
        first = exchange([Message(True, peer, mine, f"tied w@{rank}", "tied")], group=group, axis="pp", check=check)
        exchange([Message(False, peer, theirs, f"tied w@{peer}", "tied")], group=group, axis="pp", check=check).wait()
        first.wait()
        try:
            check.end_step("step 0")
        except NcclSemanticsError as err:  # both ranks raise it together: the run can go on
            return str(err)
        return "passed"


@pytest.fixture(scope="module")
def graphs():
    case = build("gpt")
    return {m: capture(case.model, case.make_batch(0, GB // m), loss_fn=case.loss_fn, annotate=False) for m in (4,)}


def test_the_former_1f1b_order_is_a_deadlock_under_nccl(graphs) -> None:
    with pytest.raises(rt.RankFailedError) as info:
        rt.launch(_unbatched, 2, args=(graphs[4], "1f1b", 4), grace_s=10)
    assert set(info.value.failures) == {0, 1}  # both pipeline ranks stop with the same verdict
    for tb in info.value.failures.values():
        assert "NcclSemanticsError: NCCL semantics (FAIRSCALE_NCCL_CHECK), step 0, ranks of the pp group: deadlock" \
            in tb, tb
        assert ("rank 0 waits in its batch 2 to send to rank 1: F1 0→1 #0 [2, 32, 64] float32 (SF1@0, step 0, after "
                "F1@0), but rank 1 is in its batch 2 (step 0, after B0@1), which sends to rank 0 too: both sides of "
                "the pair block on a send") in tb, tb


def test_the_former_v_order_sends_messages_to_the_wrong_receive(graphs) -> None:
    with pytest.raises(rt.RankFailedError) as info:
        rt.launch(_unbatched, 2, args=(graphs[4], "v", 4), grace_s=1)
    tb = info.value.failures[0]
    assert "NcclSemanticsError: NCCL semantics (FAIRSCALE_NCCL_CHECK): rank 1 → rank 0: the next message of this " \
           "pair is F3 2→3 #0 [2, 32, 64] float32 (SF3@2, step 0, after F3@2 on rank 1) but rank 0 posts the " \
           "receive of B0 1→0 #0 [2, 32, 64] float32 (RB0@0, step 0, after F2@3)" in tb, tb


def test_a_size_mismatch_is_named_before_gloo_sees_it() -> None:
    with pytest.raises(rt.RankFailedError) as info:
        rt.launch(_raw, 2, args=("size",), grace_s=1)
    tb = info.value.failures[1]
    assert ("rank 0 → rank 1: the next message of this pair is x [4] float32 (SF0@0 on rank 0) but rank 1 posts "
            "the receive of x [2] float32 (RF0@1). NCCL matches the messages between two ranks in the order they are "
            "posted, ignoring tags") in tb, tb


def test_send_then_receive_in_separate_calls_is_a_deadlock_under_nccl() -> None:
    got = rt.launch(_raw, 2, args=("send-send",))
    assert got[0] == got[1]
    assert "rank 0 waits in its batch 1 to send to rank 1: tied w@0 [3] float32 (tied), but rank 1 is in its batch " \
           "1, which sends to rank 0 too: both sides of the pair block on a send; post the sends and receives of a " \
           "pair in one batch_isend_irecv" in got[0], got[0]
