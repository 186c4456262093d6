"""Single-process GPipe (FairScale 0.4.13's ``fairscale.nn.Pipe``, the torchgpipe design).

Huang et al. 2019, "GPipe"; Kim et al. 2020, "torchgpipe". The ``nn.Sequential`` is cut into
partitions of ``balance`` layers, one per device; the mini-batch is cut into ``chunks``
micro-batches along dim 0 and run through the partitions in clock cycles (see
:mod:`fairscale.nn.pipe.pipeline`), one worker thread per device. The output is the micro-batch
outputs concatenated, on the last device; backward flows through autograd as usual. Micro-batches
may be activation-checkpointed: ``checkpoint='always'``, ``'except_last'`` (every micro-batch but
the last) or ``'never'``; only in training mode.

    from fairscale.nn import Pipe
    model = nn.Sequential(a, b, c, d)
    model = Pipe(model, balance=[2, 2], chunks=4)
    out = model(x)          # == nn.Sequential(a, b, c, d)(x)

Devices default to one CUDA device per partition, or the CPU for every partition when CUDA is not
available (FairScale 0.4.13 required CUDA). Pipe places the partitions itself: ``.cuda()``,
``.cpu()`` and ``.to(device)`` raise ``TypeError``; ``.to(dtype)`` is allowed.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn

from fairscale.nn.pipe import microbatch
from fairscale.nn.pipe.batchnorm import DeferredBatchNorm
from fairscale.nn.pipe.pipeline import Pipeline
from fairscale.nn.pipe.skip.layout import inspect_skip_layout
from fairscale.nn.pipe.skip.skippable import verify_skippables
from fairscale.nn.pipe.stream import AbstractStream, new_stream

__all__ = ["Pipe", "BalanceError"]

_CHECKPOINT_MODES = ("always", "except_last", "never")


class BalanceError(ValueError):
    """``balance`` does not fit the module."""


def recommend_auto_balance(message: str) -> str:
    """``message`` with a pointer to the automatic balancing helpers."""
    return (f"{message}\nTo compute a balance instead of writing one, use fairscale.nn.pipe.balance:\n"
            "    from fairscale.nn.pipe.balance import balance_by_time\n"
            "    balance = balance_by_time(partitions, model, sample)\n"
            "    model = Pipe(model, balance, ...)")


def verify_module(module: nn.Sequential) -> None:
    if not isinstance(module, nn.Sequential):
        raise TypeError("module must be nn.Sequential to be partitioned")
    if len(list(module.named_children())) != len(module):
        raise ValueError("module with duplicate children is not supported")


def verify_splitting(module: nn.Sequential, partitions: Sequence[nn.Sequential], devices: list[torch.device]) -> None:
    """A parameter shared by partitions on different devices cannot be placed; refuse it."""
    if len(list(module.parameters())) == sum(len(list(c.parameters())) for c in module.children()):
        return  # no parameter is shared between layers
    for i, a in enumerate(partitions):
        for j in range(i + 1, len(partitions)):
            if devices[i] == devices[j]:
                continue
            shared = {id(p) for p in a.parameters()} & {id(q) for q in partitions[j].parameters()}
            if shared:
                raise ValueError("module with duplicate parameters on distinct devices is not supported")


def split_module(module: nn.Sequential, balance: Iterable[int],
                 devices: list[torch.device]) -> tuple[nn.ModuleList, list[int], list[torch.device]]:
    """Partitions of ``balance`` layers, each moved to its device; extra devices are dropped."""
    balance = list(balance)
    if len(module) != sum(balance):
        raise BalanceError(f"module and sum of balance have different length "
                           f"(module: {len(module)}, sum of balance: {sum(balance)})")
    if any(b <= 0 for b in balance):
        raise BalanceError(f"all balance numbers must be positive integer (balance: {balance})")
    if len(balance) > len(devices):
        raise IndexError(f"too few devices to hold given partitions (devices: {len(devices)}, "
                         f"partitions: {len(balance)})")
    layers = list(module.named_children())
    partitions, start = [], 0
    for size, device in zip(balance, devices):
        partition = nn.Sequential(OrderedDict(layers[start:start + size]))
        partition.to(device)
        partitions.append(partition)
        start += size
    return nn.ModuleList(partitions), balance, devices[:len(balance)]


def _default_devices(n: int) -> list[torch.device]:
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")] * n


_MOVING_DENIED = "denied to move parameters and buffers, because Pipe should manage device placement"


class Pipe(nn.Module):
    """Wrap an ``nn.Sequential`` for pipeline-parallel training with micro-batches.

    Args:
        module: the ``nn.Sequential`` to partition.
        balance: layers per partition, e.g. ``[2, 2]`` (see ``fairscale.nn.pipe.balance``).
        devices: a device per partition (default: see the module docstring).
        chunks: micro-batches per mini-batch.
        checkpoint: ``'always'``, ``'except_last'`` or ``'never'`` activation checkpointing.
        deferred_batch_norm: replace BatchNorm layers so that running statistics follow the whole
            mini-batch rather than each micro-batch.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: invalid arguments or balance.
        IndexError: fewer devices than partitions.
    """

    def __init__(self, module: nn.Sequential, balance: Iterable[int] | None = None, devices: Any = None,
                 chunks: int = 1, checkpoint: str = "except_last", deferred_batch_norm: bool = False) -> None:
        super().__init__()
        chunks = int(chunks)
        checkpoint = str(checkpoint)
        if balance is None:
            raise ValueError(recommend_auto_balance("balance is required"))
        if chunks <= 0:
            raise ValueError("number of chunks must be positive integer")
        if checkpoint not in _CHECKPOINT_MODES:
            raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")
        verify_module(module)
        verify_skippables(module)
        self.chunks = chunks
        self.checkpoint = checkpoint
        if deferred_batch_norm:
            module = DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)
        balance = list(balance)
        devs = [torch.device(d) for d in (devices if devices is not None else _default_devices(len(balance)))]
        for d in devs:
            if d.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {d} was given but CUDA is not available; use devices=['cpu'] * "
                                 f"{len(balance)} (or leave devices unset)")
        try:
            self.partitions, self.balance, self.devices = split_module(module, balance, devs)
        except BalanceError as e:
            raise BalanceError(recommend_auto_balance(str(e))) from None
        verify_splitting(module, self.partitions, self.devices)
        self._skip_layout = inspect_skip_layout(list(self.partitions))
        # a copy stream per (partition, micro-batch), kept across steps
        self._copy_streams: list[list[AbstractStream]] = [[new_stream(d) for _ in range(chunks)] for d in self.devices]
        checkpoint_stop = {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]
        self.pipeline = Pipeline(list(self.partitions), self.devices, self._copy_streams, self._skip_layout,
                                 checkpoint_stop)

    # ------------------------------------------------------------------ the Sequential's face

    def __len__(self) -> int:
        return sum(len(p) for p in self.partitions)

    def __getitem__(self, index: int) -> nn.Module:
        layers = list(self)
        return layers[index]

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self.partitions:
            yield from partition

    # ------------------------------------------------------------------ placement is Pipe's

    def cuda(self, device: Any = None) -> "Pipe":
        raise TypeError(_MOVING_DENIED)

    def cpu(self) -> "Pipe":
        raise TypeError(_MOVING_DENIED)

    def to(self, *args: Any, **kwargs: Any) -> "Pipe":
        """Only ``to(dtype)`` (casting); moving to a device or like a tensor raises ``TypeError``."""
        if "device" in kwargs or "tensor" in kwargs:
            raise TypeError(_MOVING_DENIED)
        if args and (isinstance(args[0], (torch.device, int, str)) or torch.is_tensor(args[0])):
            raise TypeError(_MOVING_DENIED)
        return super().to(*args, **kwargs)

    # ------------------------------------------------------------------ forward

    def forward(self, input: microbatch.TensorOrTensors) -> microbatch.TensorOrTensors:  # noqa: A002
        """Run the mini-batch through the pipeline; returns the output on the last device.

        ``input`` is a tensor or a tuple of tensors; a partition receives what the previous one
        returned (a tensor, or a tuple as one argument), as in ``nn.Sequential``.
        """
        microbatch.check(input)
        if not self.devices:
            return input  # an empty Sequential
        batches = microbatch.scatter(input, self.chunks)
        self.pipeline.run(batches)
        return microbatch.gather(batches)
