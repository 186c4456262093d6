"""The NCCL semantics checker: run the pipeline's point-to-point on gloo as NCCL would judge it.

gloo is forgiving where NCCL is not: a tagged gloo message finds its receive in any order, and
a gloo send does not hold up the next call. Code that passes every CPU test can hang or corrupt
data on GPUs. With the checker on (``PipelineExecutor(..., nccl_check=True)``, or
``FAIRSCALE_NCCL_CHECK=1`` in the environment of every rank), every batch the pipeline posts
through :func:`fairscale.runtime.p2p.exchange` (``check=``) is checked twice:

1. **As it is posted, per message.** Each message is preceded, on a side channel (gloo tag 1;
   the payloads keep tag 0, which gloo matches per pair in order, like NCCL), by a small header
   with its name, shape and dtype; the receiver reads the header before it posts the receive and
   raises :class:`NcclSemanticsError` if the message that comes next in the pair's order is not
   the one it expects. Without the header, a size mismatch aborts gloo with no message and an
   order mismatch of equal sizes silently swaps tensors.
2. **At the end of each step, all batches together.** The pipeline ranks all-gather the batches
   each posted in the step (messages, shapes, schedule actions, where) and every rank runs
   ``planner.p2p_model.check_p2p``: per-pair order and sizes, and NCCL's rendezvous (a send
   completes only while the peer runs the matching receive; a rank's batches run in order), which
   gloo does not enforce. A possible deadlock, e.g. both ranks of a pair sending first in
   separate calls, fails the step on every pipeline rank with the ranks, step and actions.

It costs a header per message and one small all-gather per step, so it is for tests: the test
suite turns it on for every pipeline run (``tests/conftest.py``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

from fairscale.runtime import p2p
from passes.ops import comm
from passes.ops.flight import RECORDER
from planner.p2p_model import P2PBatch, P2POp, P2POrderError, check_p2p

__all__ = ["NcclSemanticsError", "NcclChecker", "checker", "wanted", "ENV"]

ENV = "FAIRSCALE_NCCL_CHECK"
"""Environment variable that turns the checker on for every pipeline executor (``1``)."""
HEADER_TAG = 1
HEADER_BYTES = 512


class NcclSemanticsError(RuntimeError):
    """Point-to-point that NCCL would mismatch or deadlock on."""


def wanted(option: bool | None) -> bool:
    """``option`` if given, else whether ``FAIRSCALE_NCCL_CHECK`` is set to 1."""
    return option if option is not None else os.environ.get(ENV, "") not in ("", "0")


def _signature(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"


class NcclChecker:
    """Checks this rank's batches on ``axis`` (see the module docstring); one per executor."""

    def __init__(self, axis: str) -> None:
        if dist.get_backend(comm.get_group(axis)) != "gloo":
            raise NcclSemanticsError(f"the NCCL semantics checker runs on gloo (CPU ranks); this {axis} group uses "
                                     f"{dist.get_backend(comm.get_group(axis))!r}, whose own semantics apply: unset "
                                     f"{ENV} or pass nccl_check=False")
        self.axis = axis
        self.batches: list[P2PBatch] = []
        self._headers: list[Any] = []

    # --- as posted ----------------------------------------------------------------------------

    def __call__(self, messages: Sequence[p2p.Message], group: Any) -> None:
        """Record the batch about to be posted, and check each message it receives against its header."""
        where = RECORDER.context
        self.batches.append(P2PBatch(tuple(P2POp(send=m.send, peer=dist.get_group_rank(group, m.peer),
                                                 message=m.name, signature=_signature(m.tensor), action=m.action)
                                           for m in messages), where=where))
        ops, expected = [], []
        for m in messages:
            if m.send:
                header = {"name": m.name, "signature": _signature(m.tensor), "action": m.action, "where": where}
                ops.append(dist.P2POp(dist.isend, _encode(header), m.peer, group, tag=HEADER_TAG))
            else:
                buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device="cpu")  # lint: cpu -- gloo side channel
                ops.append(dist.P2POp(dist.irecv, buf, m.peer, group, tag=HEADER_TAG))
                expected.append((m, buf))
        entry = RECORDER.post("p2p", self.axis, "NCCL check headers: " + "; ".join(m.describe() for m in messages))
        works = dist.batch_isend_irecv(ops)
        self._headers += [w for m, w in zip(messages, works) if m.send]
        RECORDER.wait(entry, lambda: [w.wait() for m, w in zip(messages, works) if not m.send])
        me = dist.get_rank()
        for m, buf in expected:
            got = json.loads(bytes(buf.tolist()).rstrip(b"\0").decode())
            if got["name"] != m.name or got["signature"] != _signature(m.tensor):
                theirs = ", ".join(x for x in (got["action"], got["where"]) if x)
                ours = ", ".join(x for x in (m.action, where) if x)
                raise NcclSemanticsError(
                    f"NCCL semantics ({ENV}): rank {m.peer} → rank {me}: the next message of this pair is {got['name']} "
                    f"{got['signature']} ({theirs} on rank {m.peer}) but rank {me} posts the receive of {m.name} "
                    f"{_signature(m.tensor)} ({ours}). NCCL matches the messages "
                    "between two ranks in the order they are posted, ignoring tags: both sides must post them in "
                    "the same order")

    # --- per step -----------------------------------------------------------------------------

    def end_step(self, where: str) -> None:
        """Check the step's batches of every rank on the axis together (collective over the axis)."""
        if self._headers:
            entry = RECORDER.post("p2p", self.axis, "NCCL check headers sent this step")
            RECORDER.wait(entry, lambda: [w.wait() for w in self._headers])
        self._headers = []
        programs = comm.all_gather_object(self.batches, self.axis, what="the step's point-to-point batches")
        self.batches = []
        try:
            check_p2p(programs)
        except P2POrderError as err:
            raise NcclSemanticsError(f"NCCL semantics ({ENV}), {where}, ranks of the {self.axis} group: {err}") from None


def _encode(header: dict[str, str]) -> torch.Tensor:
    data = json.dumps(header).encode()
    if len(data) > HEADER_BYTES:
        header = dict(header, where=header["where"][:40])
        data = json.dumps(header).encode()[:HEADER_BYTES]
    out = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device="cpu")  # lint: cpu -- gloo side channel
    out[:len(data)] = torch.tensor(list(data), dtype=torch.uint8, device="cpu")  # lint: cpu -- gloo side channel
    return out


def checker(axis: str) -> NcclChecker | None:
    """A checker for the executor on ``axis``; None when the axis has one rank (nothing to check)."""
    return NcclChecker(axis) if comm.group_size(axis) > 1 else None
