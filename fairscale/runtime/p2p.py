"""Point-to-point of the pipeline: batches of sends and receives posted together, without tags.

NCCL matches the messages between two ranks in the order they are posted and ignores tags, and
a send completes only while the peer runs the matching receive (``planner.p2p_model``). So, as
``torch.distributed.pipelining`` and Megatron-LM do, every exchange is one
``torch.distributed.batch_isend_irecv`` of :class:`Message` s whose order both ranks of each pair
agree on (the executor posts ``planner.schedule_batched``'s batches; tied weights post one batch),
and nothing carries a tag. The same code runs on gloo, which matches untagged messages per pair in
order too.

:func:`exchange` posts a batch, counts its bytes in ``comm.COUNTER``, posts it to the flight
record (``passes.ops.flight``) with the messages' names, and hands it first to ``check``, the NCCL
semantics checker when it is on (``fairscale.runtime.nccl_check``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from passes.ops import comm
from passes.ops.flight import RECORDER, Entry

__all__ = ["Message", "Batch", "Check", "exchange", "format_specs"]


@dataclass
class Message:
    """One tensor to send to, or receive from, ``peer``."""

    send: bool
    peer: int
    """Global rank of the other side."""
    tensor: torch.Tensor
    """What is sent, or the buffer a receive fills."""
    name: str
    """The message's name, the same on both sides: ``F3 0→1 #0`` (activation of microbatch 3 from
    stage 0 to stage 1, value 0), ``B3 1→0 #0`` (a gradient), ``tied wte.weight@0``."""
    action: str
    """This side's schedule action: ``SF3@0``, ``RF3@1``, ``tied``."""

    def describe(self) -> str:
        arrow = "to" if self.send else "from"
        return f"{'send' if self.send else 'recv'} {self.name} {arrow} rank {self.peer}"


class Batch:
    """The works of one posted batch; :meth:`wait` (idempotent) waits through the flight record,
    then drops the works: a work holds its tensors (a receive's buffer, a sent activation), and a
    batch kept to wait for its sends must not keep a received activation alive after its backward."""

    def __init__(self, works: Sequence[Any], entry: Entry | None) -> None:
        self._works = list(works)
        self._entry = entry
        self._done = not self._works

    def wait(self) -> None:
        if self._done:
            return
        assert self._entry is not None
        RECORDER.wait(self._entry, lambda: [w.wait() for w in self._works])
        self._works, self._done = [], True


Check = Callable[[Sequence[Message], Any], None]
"""A hook that sees every batch (its messages and group) before it is posted:
``fairscale.runtime.nccl_check.NcclChecker``."""


def exchange(messages: Sequence[Message], *, group: Any, axis: str, check: Check | None = None) -> Batch:
    """Post ``messages`` as one ``batch_isend_irecv`` on ``group`` (no tags); returns its :class:`Batch`."""
    if not messages:
        return Batch([], None)
    if check is not None:
        check(messages, group)
    for m in messages:
        nbytes = m.tensor.numel() * m.tensor.element_size()
        comm.count("send" if m.send else "recv", axis, nbytes, float(nbytes))
    entry = RECORDER.post("p2p", axis, "; ".join(m.describe() for m in messages),
                          nbytes=sum(m.tensor.numel() * m.tensor.element_size() for m in messages), size=2)
    ops = [dist.P2POp(dist.isend if m.send else dist.irecv, m.tensor, m.peer, group) for m in messages]
    return Batch(dist.batch_isend_irecv(ops), entry)


def format_specs(specs: Sequence[tuple[tuple[int, ...], Any]]) -> str:
    return "[" + ", ".join(f"{list(shape)}:{str(d).replace('torch.', '')}" for shape, d in specs) + "]"
