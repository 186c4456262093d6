"""CUDA streams and a stand-in for the CPU, so pipeline code is the same on both.

On the CPU every operation is synchronous: :data:`CPUStream` is the one "stream", waiting on it is
a no-op and so is recording a tensor on it. On CUDA these are ``torch.cuda.Stream`` calls.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Union, cast

import torch

__all__ = ["CPUStreamType", "CPUStream", "AbstractStream", "new_stream", "current_stream", "default_stream",
           "use_device", "use_stream", "get_device", "wait_stream", "record_stream", "is_cuda", "as_cuda"]


class CPUStreamType:
    """The type of :data:`CPUStream`."""


CPUStream = CPUStreamType()
"""The CPU's only stream."""

AbstractStream = Union[torch.cuda.Stream, CPUStreamType]


def new_stream(device: torch.device) -> AbstractStream:
    """A new stream on ``device`` (:data:`CPUStream` for the CPU)."""
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.Stream(device)


def current_stream(device: torch.device) -> AbstractStream:
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.current_stream(device)


def default_stream(device: torch.device) -> AbstractStream:
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.default_stream(device)


@contextlib.contextmanager
def use_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` CUDA's current device in the block (nothing for the CPU)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


@contextlib.contextmanager
def use_stream(stream: AbstractStream) -> Iterator[None]:
    """Make ``stream`` current in the block (nothing for :data:`CPUStream`)."""
    if not is_cuda(stream):
        yield
        return
    with torch.cuda.stream(as_cuda(stream)):
        yield


def get_device(stream: AbstractStream) -> torch.device:
    if is_cuda(stream):
        return as_cuda(stream).device
    return torch.device("cpu")


def wait_stream(source: AbstractStream, target: AbstractStream) -> None:
    """Make ``source`` wait for what is queued on ``target`` (the host waits, if ``source`` is the CPU)."""
    if not is_cuda(target):
        return  # the CPU has nothing queued
    if is_cuda(source):
        as_cuda(source).wait_stream(as_cuda(target))
    else:
        as_cuda(target).synchronize()


def record_stream(tensor: torch.Tensor, stream: AbstractStream) -> None:
    """Keep ``tensor``'s memory from reuse until ``stream``'s queued work is done (CUDA only).

    Recorded on a tensor spanning the whole storage: recording a view that starts inside the
    storage would not protect the block (pytorch issue 27366).
    """
    if not is_cuda(stream):
        return
    whole = tensor.new_empty([0]).set_(tensor.untyped_storage())
    whole.record_stream(as_cuda(stream))


def is_cuda(stream: AbstractStream) -> bool:
    return stream is not CPUStream


def as_cuda(stream: AbstractStream) -> torch.cuda.Stream:
    return cast(torch.cuda.Stream, stream)
