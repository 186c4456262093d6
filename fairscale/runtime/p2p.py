"""Point-to-point plumbing of the pipeline executor: message tags, typed isend/irecv, and the
compact encoding of boundary specs exchanged in the first-step shape handshake."""

from __future__ import annotations

import datetime
from typing import Any, Sequence

import torch
import torch.distributed as dist

from passes.program import ValueSpec
from planner.schedule import ScheduleError

KIND_CODE = {"F": 0, "B": 1, "SHAKE": 2, "TIED": 3}
"""Message kinds: activations, gradients, handshake specs, tied-weight gradients."""
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64]
"""Dtype codes of the handshake encoding (99 = another dtype)."""


class P2PError(RuntimeError):
    """A point-to-point op could not be posted (this rank is outside the group)."""


def tag(kind: str, mb: int, stage: int, index: int) -> int:
    """A unique message tag: 2 bits kind, 10 bits stage, 13 bits microbatch, 6 bits value index."""
    if stage >= 1024 or mb >= 8192 or index >= 64:
        raise ScheduleError(f"too many stages ({stage}), microbatches ({mb}) or boundary values ({index}) "
                            "for message tags; at most 1024 stages, 8192 microbatches, 64 values")
    return ((KIND_CODE[kind] * 1024 + stage) * 8192 + mb) * 64 + index


def send(t: torch.Tensor, peer: int, *, group: Any, tag: int) -> Any:
    work = dist.isend(t, peer, group=group, tag=tag)
    if work is None:
        raise P2PError(f"this rank is not in the pipeline group of peer {peer}")
    return work


def recv(t: torch.Tensor, peer: int, *, group: Any, tag: int) -> Any:
    work = dist.irecv(t, peer, group=group, tag=tag)
    if work is None:
        raise P2PError(f"this rank is not in the pipeline group of peer {peer}")
    return work


_TIMEOUT: datetime.timedelta | None = None


def set_timeout(timeout: datetime.timedelta | None) -> None:
    """How long a pipeline wait may block (``fairscale.runtime.mesh.build_mesh`` sets the world's)."""
    global _TIMEOUT
    _TIMEOUT = timeout


class P2PTimeout(RuntimeError):
    """A pipeline send or receive did not complete: the collective timeout passed, or the peer failed."""


def wait_all(pending: list[tuple[Any, torch.Tensor]], *, what: str = "", peer: int | None = None) -> list[torch.Tensor]:
    """Wait for posted sends or receives, at most the collective timeout each; a timeout names
    ``what`` was awaited and from which ``peer`` (pp-group rank)."""
    for work, _ in pending:
        try:
            ok = work.wait(_TIMEOUT) if _TIMEOUT is not None else work.wait()
        except RuntimeError as exc:
            raise P2PTimeout(_stuck(what, peer, exc)) from exc
        if ok is False:
            raise P2PTimeout(_stuck(what, peer, None))
    return [buf for _, buf in pending]


def _stuck(what: str, peer: int | None, exc: BaseException | None) -> str:
    who = f"pipeline rank {peer}" if peer is not None else "the peer"
    awaited = what or "a pipeline message"
    if exc is not None and "time" not in str(exc).lower():  # the peer closed the connection: it failed
        first = str(exc).splitlines()[0][:300]
        return f"{awaited} from {who} never came: the connection failed ({type(exc).__name__}: {first})"
    limit = f"{_TIMEOUT.total_seconds():.0f} s" if _TIMEOUT is not None else "the timeout"
    return (f"waited {limit} (the collective timeout) for {awaited} from {who}, which is stuck or dead; "
            "the launcher reports the rank that failed first")


def encode_specs(specs: Sequence[ValueSpec]) -> list[int]:
    out = [len(specs)]
    for s in specs:
        out += [len(s.shape), *s.shape, DTYPES.index(s.dtype) if s.dtype in DTYPES else 99]
    return out


def decode_specs(code: list[int]) -> list[tuple[tuple[int, ...], Any]]:
    out, i = [], 1
    for _ in range(code[0]):
        nd = code[i]
        shape = tuple(code[i + 1:i + 1 + nd])
        d = code[i + 1 + nd]
        out.append((shape, DTYPES[d] if d < len(DTYPES) else "other"))
        i += 2 + nd
    return out


def format_specs(specs: list[tuple[tuple[int, ...], Any]]) -> str:
    return "[" + ", ".join(f"{list(shape)}:{str(d).replace('torch.', '')}" for shape, d in specs) + "]"
