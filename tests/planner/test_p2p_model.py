"""NCCL's point-to-point semantics as a model (``planner.p2p_model``), and the batched order of every
schedule kind (``planner.schedule_batched``) that the executor posts."""

from __future__ import annotations

import re

import pytest

from planner.p2p_model import P2PBatch, P2POp, P2POrderError, check_p2p
from planner.schedule import build_schedule, check_nccl_order
from planner.schedule_batched import batch_p2p, message_key, peer_stage
from planner.schedule_ir import COMM, PipelineSchedule

KINDS = [(k, p, m, 1) for k in ("gpipe", "1f1b") for p in (2, 3, 4) for m in (1, p, 2 * p + 1) if k == "gpipe" or m >= p]
KINDS += [("interleaved", p, m, v) for p in (2, 4) for m in (p, 2 * p) for v in (2, 3)]
KINDS += [("v", p, m, 2) for p in (2, 3, 4) for m in (1, p, 2 * p + 1)]


def _send(peer: int, msg: str, sig: str = "") -> P2POp:
    return P2POp(send=True, peer=peer, message=msg, signature=sig, action=f"S{msg}")


def _recv(peer: int, msg: str, sig: str = "") -> P2POp:
    return P2POp(send=False, peer=peer, message=msg, signature=sig, action=f"R{msg}")


def _one_per_batch(sched: PipelineSchedule) -> list[list[P2PBatch]]:
    """The order of ``lower()`` (receive before the compute, send after it), one call per message:
    what the executor posted before it batched its point-to-point."""
    progs = []
    for acts in sched.lower().actions:
        progs.append([P2PBatch((P2POp(send=a.kind[0] == "S", peer=sched.stage_rank(peer_stage(a)),
                                      message="{}{} from {}".format(*message_key(a)), action=a.token()),))
                      for a in acts if a.kind in COMM])
    return progs


@pytest.mark.parametrize("kind,pp,m,v", KINDS)
def test_every_kind_posts_in_an_order_nccl_runs(kind: str, pp: int, m: int, v: int) -> None:
    sched = build_schedule(kind, pp=pp, microbatches=m, virtual_stages=v)
    for s in (sched, sched.forward_only()):
        program = check_nccl_order(s)
        # the computes are the schedule's, in its order; every message is posted once on each side
        for r, steps in enumerate(program.steps):
            assert [x for x in steps if not hasattr(x, "actions")] == s.compute_only().actions[r]
        comm = sorted(str(a) for steps in program.steps for x in steps for a in getattr(x, "actions", ()))
        assert comm == sorted(str(a) for acts in s.lower().actions for a in acts if a.kind in COMM)


def test_batches_pair_sends_with_the_receives_of_the_same_moment() -> None:
    # 1F1B in its steady state: a forward's output goes out with the receive of the gradient the
    # next backward needs, a backward's with the next forward's input (Megatron-LM's
    # send_forward_recv_backward and send_backward_recv_forward)
    program = batch_p2p(build_schedule("1f1b", pp=4, microbatches=8))
    assert program.rank_text(0) == ("F0 [SF0] F1 [SF1] F2 [SF2] F3 [SF3] [RB0] B0 F4 [RB1 SF4] B1 F5 [RB2 SF5] B2 "
                                    "F6 [RB3 SF6] B3 F7 [RB4 SF7] B4 [RB5] B5 [RB6] B6 [RB7] B7")
    assert program.rank_text(1).startswith("[RF0] F0 [SF0 RF1] F1 [SF1 RF2] F2 [SF2 RF3] [RB0] B0 [SB0] F3 "
                                           "[RB1 SF3] B1 [SB1 RF4] F4")


def test_the_unbatched_order_deadlocks_or_mismatches_under_nccl() -> None:
    """Why the executor batches: one call per message in ``lower()``'s order deadlocks 1F1B (both
    neighbours send first) and matches the V schedule's messages to the wrong receives."""
    with pytest.raises(P2POrderError, match=r"rank 0 waits in its batch 2 to send to rank 1: F1 from 0 \(SF1@0\), "
                                            r"but rank 1 is in its batch 2, which sends to rank 0 too: both sides of "
                                            r"the pair block on a send"):
        check_p2p(_one_per_batch(build_schedule("1f1b", pp=2, microbatches=4)))
    with pytest.raises(P2POrderError, match=r"rank 1 → rank 0: message 4 of this pair is F3 from 2 \(SF3@2\) on rank "
                                            r"1 but rank 0 receives B0 from 1 \(RB0@0\) there. NCCL matches"):
        check_p2p(_one_per_batch(build_schedule("v", pp=2, microbatches=4, virtual_stages=2)))


def test_mismatched_signature_and_count_are_named() -> None:
    ok = [[P2PBatch((_send(1, "a", "[2] float32"),), where="step 0")], [P2PBatch((_recv(0, "a", "[2] float32"),))]]
    check_p2p(ok)
    bad = [[P2PBatch((_send(1, "a", "[2] float32"),), where="step 0")], [P2PBatch((_recv(0, "a", "[4] float32"),))]]
    with pytest.raises(P2POrderError, match=re.escape("rank 0 → rank 1: message 1 of this pair is a [2] float32 "
                                                      "(Sa, step 0) on rank 0 but rank 1 receives a [4] float32 (Ra)")):
        check_p2p(bad)
    extra = [[P2PBatch((_send(1, "a"), _send(1, "b")))], [P2PBatch((_recv(0, "a"),))]]
    with pytest.raises(P2POrderError, match=re.escape("rank 0 posts 2 sends to rank 1, which posts 1 receives from "
                                                      "rank 0; the first without a partner is b (Sb) on rank 0")):
        check_p2p(extra)
    with pytest.raises(P2POrderError, match="rank 0 posts a send to rank 0, which is not another of the 2 ranks"):
        check_p2p([[P2PBatch((_send(0, "a"),))], []])


def test_a_batch_runs_its_operations_together_but_batches_run_in_order() -> None:
    # both orders of one exchange work in one batch ...
    check_p2p([[P2PBatch((_send(1, "x"), _recv(1, "y")))], [P2PBatch((_send(0, "y"), _recv(0, "x")))]])
    # ... a receive posted in a later batch than the partner's batch is fine if nothing waits in between ...
    check_p2p([[P2PBatch((_send(1, "x"),)), P2PBatch((_send(1, "z"),))], [P2PBatch((_recv(0, "x"), _recv(0, "z")))]])
    # ... but three ranks that each pair up consistently can still wait in a ring
    ring = [[P2PBatch((_send(1, "ab"),)), P2PBatch((_recv(2, "ca"),))],
            [P2PBatch((_send(2, "bc"),)), P2PBatch((_recv(0, "ab"),))],
            [P2PBatch((_send(0, "ca"),)), P2PBatch((_recv(1, "bc"),))]]
    with pytest.raises(P2POrderError, match=r"deadlock under NCCL's semantics.*rank 0 waits in its batch 1 to send to "
                                            r"rank 1: ab \(Sab\), but rank 1 is in its batch 1 and posts the receive "
                                            r"only in its batch 2"):
        check_p2p(ring)
