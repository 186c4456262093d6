"""NCCL's point-to-point semantics as a model: message matching per rank pair, and deadlock.

NCCL (and ``torch.distributed`` on it) differs from gloo in two ways that matter to a pipeline:

1. **Order, not tags.** The messages from rank a to rank b are matched in the order a posts its
   sends and b posts its receives; tags are ignored. The k-th send a → b meets the k-th receive
   on b from a, and they must agree in size and dtype (NCCL does not check: a mismatch is a hang
   or corrupt data).
2. **Rendezvous on one stream.** A send completes only while the peer's matching receive is
   running, and a rank's point-to-point calls run one after the other on its communicator's
   stream. ``batch_isend_irecv`` groups calls into one NCCL kernel (``ncclGroupStart/End``) whose
   operations progress together; separate calls do not. Two ranks that each send to the other in
   separate calls before receiving block forever.

A *program* is each rank's list of :class:`P2PBatch` in posting order (one ``batch_isend_irecv``
each). :func:`check_p2p` checks it the way NCCL would run it: first the matching (per ordered
pair, the k-th send against the k-th receive: same message, same signature), then the execution,
batch after batch on each rank, where an operation completes when its partner's batch is the one
its rank is running, and a batch completes when all its operations have. This is the strictest
reading (everything on one stream per rank); a program it passes runs on NCCL with any stream
assignment. It raises :class:`P2POrderError` naming the ranks, the messages, where each side posts
them and, for a deadlock, what every blocked rank waits for.

Used by ``planner.schedule_batched`` (a schedule's own order, before anything runs) and by
``fairscale.runtime.nccl_check`` (the operations real ranks posted, on gloo).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Sequence

from planner.schedule_ir import ScheduleError

__all__ = ["P2POp", "P2PBatch", "P2POrderError", "check_p2p"]


class P2POrderError(ScheduleError):
    """Point-to-point operations that NCCL would mismatch or deadlock on."""


@dataclass(frozen=True)
class P2POp:
    """One send or receive of one tensor."""

    send: bool
    """True for a send, False for a receive."""
    peer: int
    """The other rank (an index into the program's ranks)."""
    message: str
    """The message's name, the same on both sides, e.g. ``F3 0→1 #0`` (activation of microbatch
    3 from stage 0 to stage 1, value 0): a different name at the same place in the order is a
    mismatch even when sizes agree."""
    signature: str = ""
    """What NCCL needs to agree: shape and dtype, e.g. ``[2, 32, 64] float64``."""
    action: str = ""
    """The schedule action on this side, e.g. ``SF3@0``."""


@dataclass(frozen=True)
class P2PBatch:
    """One ``batch_isend_irecv``: operations posted together."""

    ops: tuple[P2POp, ...]
    where: str = ""
    """Where the rank posts it, e.g. ``step 2, after F3@0``."""


Place = tuple[int, int, int]  # (rank, batch index, op index)


def check_p2p(programs: Sequence[Sequence[P2PBatch]]) -> None:
    """Raise :class:`P2POrderError` unless ``programs`` (one list of batches per rank) match and
    run to completion under NCCL's semantics (module docstring)."""
    partner = _match(programs)
    _execute(programs, partner)


def _op(programs: Sequence[Sequence[P2PBatch]], at: Place) -> P2POp:
    return programs[at[0]][at[1]].ops[at[2]]


def _side(programs: Sequence[Sequence[P2PBatch]], at: Place) -> str:
    op = _op(programs, at)
    where = programs[at[0]][at[1]].where
    what = f"{op.message}" + (f" {op.signature}" if op.signature else "")
    ctx = ", ".join(x for x in (op.action, where) if x)
    return what + (f" ({ctx})" if ctx else "")


def _match(programs: Sequence[Sequence[P2PBatch]]) -> dict[Place, Place]:
    n = len(programs)
    sends: dict[tuple[int, int], list[Place]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Place]] = defaultdict(list)
    for r, prog in enumerate(programs):
        for b, batch in enumerate(prog):
            for k, op in enumerate(batch.ops):
                if not 0 <= op.peer < n or op.peer == r:
                    raise P2POrderError(f"rank {r} posts {'a send to' if op.send else 'a receive from'} rank "
                                        f"{op.peer}, which is not another of the {n} ranks ({_side(programs, (r, b, k))})")
                if op.send:
                    sends[(r, op.peer)].append((r, b, k))
                else:
                    recvs[(op.peer, r)].append((r, b, k))
    partner: dict[Place, Place] = {}
    for src, dst in sorted(set(sends) | set(recvs)):
        out, into = sends[(src, dst)], recvs[(src, dst)]
        for i, (s, v) in enumerate(zip(out, into)):
            so, vo = _op(programs, s), _op(programs, v)
            if so.message != vo.message or so.signature != vo.signature:
                raise P2POrderError(
                    f"rank {src} → rank {dst}: message {i + 1} of this pair is {_side(programs, s)} on rank {src} "
                    f"but rank {dst} receives {_side(programs, v)} there. NCCL matches the messages between two "
                    "ranks in the order they are posted and ignores tags: post sends and receives of a pair in the "
                    "same order on both sides")
            partner[s], partner[v] = v, s
        if len(out) != len(into):
            more, fewer = (out, into) if len(out) > len(into) else (into, out)
            extra = more[len(fewer)]
            raise P2POrderError(
                f"rank {src} posts {len(out)} sends to rank {dst}, which posts {len(into)} receives from rank {src}; "
                f"the first without a partner is {_side(programs, extra)} on rank {extra[0]}")
    return partner


def _execute(programs: Sequence[Sequence[P2PBatch]], partner: dict[Place, Place]) -> None:
    """Run every rank's batches in order; an operation completes when its partner's batch is the
    one the partner's rank is in. A rank is revisited only when one of its operations completed."""
    n = len(programs)
    head = [0] * n
    done: set[Place] = set()
    queue = deque(range(n))
    while queue:
        r = queue.popleft()
        while head[r] < len(programs[r]):
            b = head[r]
            for k in range(len(programs[r][b].ops)):
                if (r, b, k) not in done:
                    other = partner[(r, b, k)]
                    if head[other[0]] == other[1]:
                        done.update(((r, b, k), other))
                        queue.append(other[0])  # its batch may be complete now
            if not all((r, b, k) in done for k in range(len(programs[r][b].ops))):
                break
            head[r] += 1
    blocked = [r for r in range(n) if head[r] < len(programs[r])]
    if blocked:
        raise P2POrderError("deadlock under NCCL's semantics (a send completes only while the peer runs the "
                            "matching receive; a rank's batches run in order): "
                            + "; ".join(_blocked(programs, partner, head, done, r) for r in blocked))


def _blocked(programs: Sequence[Sequence[P2PBatch]], partner: dict[Place, Place], head: list[int],
             done: set[Place], r: int) -> str:
    b = head[r]
    batch = programs[r][b]
    k = next(k for k in range(len(batch.ops)) if (r, b, k) not in done)
    op = batch.ops[k]
    pr, pb, _ = partner[(r, b, k)]
    verb = "send to" if op.send else "receive from"
    text = f"rank {r} waits in its batch {b + 1} to {verb} rank {pr}: {_side(programs, (r, b, k))}"
    if head[pr] < len(programs[pr]):
        theirs = programs[pr][head[pr]]
        text += f", but rank {pr} is in its batch {head[pr] + 1}" + (f" ({theirs.where})" if theirs.where else "")
        mine_first = [o for o in theirs.ops if o.peer == r]
        if op.send and mine_first and all(o.send for o in mine_first):
            text += (f", which sends to rank {r} too: both sides of the pair block on a send; post the sends and "
                     "receives of a pair in one batch_isend_irecv")
        else:
            text += f" and posts the receive only in its batch {pb + 1}" if op.send else \
                f" and posts the send only in its batch {pb + 1}"
    return text
