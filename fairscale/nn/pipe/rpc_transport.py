"""Messages between the stages of an :class:`~fairscale.nn.pipe.AsyncPipe`, over torch.distributed.rpc.

A sender calls ``rpc_sync`` on the receiving worker (named by ``worker_map``), which puts the
message into that process's inbox for the key ``(pipe, kind)``; the receiver takes messages from
its inbox in arrival order. Tensors travel on the CPU (TensorPipe needs no device map then) and are
moved to the receiver's ``input_device``. ``None`` stands for the missing gradient of a
non-floating-point tensor.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Sequence

import torch
from torch.distributed import rpc

__all__ = ["RpcTransport"]

_INBOXES: dict[tuple[int, str], "queue.Queue[tuple[int, list[torch.Tensor | None]]]"] = {}
_LOCK = threading.Lock()


def _inbox(key: tuple[int, str]) -> "queue.Queue[tuple[int, list[torch.Tensor | None]]]":
    with _LOCK:
        return _INBOXES.setdefault(key, queue.Queue())


def _deliver(key: tuple[int, str], index: int, tensors: list[torch.Tensor | None]) -> None:
    """Runs on the receiving worker (an RPC thread)."""
    _inbox(key).put((index, tensors))


class RpcTransport:
    """Send and receive ``(micro-batch index, tensors)`` messages of pipe ``pipe_id``."""

    def __init__(self, worker_map: dict[int, str] | None, pipe_id: int, input_device: torch.device) -> None:
        if worker_map is None:
            raise ValueError("'RpcTransport' requires 'worker_map' to be set: AsyncPipe sends activations and "
                             "gradients between stages over torch.distributed.rpc; pass worker_map={global rank: "
                             "rpc worker name} (the names given to rpc.init_rpc)")
        self.worker_map = worker_map
        self.pipe_id = pipe_id
        self.input_device = input_device

    def send(self, dst_global_rank: int, kind: str, index: int, tensors: Sequence[torch.Tensor | None]) -> None:
        payload = [None if t is None else t.detach().cpu() for t in tensors]
        rpc.rpc_sync(self.worker_map[dst_global_rank], _deliver, args=((self.pipe_id, kind), index, payload))

    def recv(self, kind: str) -> tuple[int, list[torch.Tensor | None]]:
        index, tensors = _inbox((self.pipe_id, kind)).get()
        return index, [None if t is None else t.to(self.input_device) for t in tensors]

    def pending(self, kind: str) -> Any:
        return _inbox((self.pipe_id, kind)).qsize()
