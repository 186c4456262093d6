"""Single-process GPipe (FairScale 0.4.13's ``fairscale.nn.Pipe``, the torchgpipe design).

Huang et al. 2019, "GPipe"; Kim et al. 2020, "torchgpipe". The ``nn.Sequential`` is cut into
partitions of ``balance`` layers, one per device; the mini-batch is cut into ``chunks``
micro-batches along dim 0; micro-batch ``i`` runs on partition ``j`` at clock ``i + j``::

    clock      0    1    2    3    4          (chunks=3, 3 partitions)
    part 0    F0   F1   F2
    part 1         F0   F1   F2
    part 2              F0   F1   F2

The output is the micro-batch outputs concatenated, on the last device, and backward flows
through autograd as usual. Each (micro-batch, partition) cell may be activation-checkpointed:
``checkpoint='always'``, ``'except_last'`` (every micro-batch but the last) or ``'never'``.

    from fairscale.nn import Pipe
    model = nn.Sequential(a, b, c, d)
    model = Pipe(model, balance=[2, 2], chunks=4)
    out = model(x)          # == nn.Sequential(a, b, c, d)(x)

Runs the cells in clock order in the calling thread: on CPU partitions this is exactly the
sequential computation; across CUDA devices it places each partition on its device and moves
activations between them (no per-device worker threads).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from fairscale.nn.pipe.batchnorm import DeferredBatchNorm, checkpointing, recomputing
from fairscale.nn.pipe.skip.skippable import verify_skippables
from fairscale.nn.pipe.skip.tracker import SkipTracker, use_skip_tracker

__all__ = ["Pipe", "BalanceError"]

_CHECKPOINT_MODES = ("always", "except_last", "never")


class BalanceError(ValueError):
    """``balance`` does not fit the module or the devices."""


def _default_devices(n: int) -> list[torch.device]:
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return [torch.device("cuda", i % count) for i in range(n)] if count >= n else \
            [torch.device("cuda", i) for i in range(count)]
    return [torch.device("cpu")] * n


def _split_module(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    layers = list(module.named_children())
    out, start = [], 0
    for size in balance:
        out.append(nn.Sequential(OrderedDict(layers[start:start + size])))
        start += size
    return out


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def _scatter(inputs: tuple[torch.Tensor, ...], chunks: int) -> list[tuple[torch.Tensor, ...]]:
    for t in inputs:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"Pipe inputs must be tensors or a tuple of tensors, got {type(t).__name__}")
    parts = [t.chunk(chunks) for t in inputs]
    n = len(parts[0])
    if any(len(p) != n for p in parts):
        raise ValueError("all Pipe inputs must have the same batch size (dim 0)")
    return [tuple(p[i] for p in parts) for i in range(n)]


class Pipe(nn.Module):
    """Wrap an ``nn.Sequential`` for pipeline-parallel training with micro-batches.

    Args:
        module: the ``nn.Sequential`` to partition.
        balance: layers per partition, e.g. ``[2, 2]`` (see ``fairscale.nn.pipe.balance``).
        devices: a device per partition (default: ``cuda:0..`` when CUDA is available, else CPU).
        chunks: micro-batches per mini-batch.
        checkpoint: ``'always'``, ``'except_last'`` or ``'never'`` activation checkpointing.
        deferred_batch_norm: replace BatchNorm layers so that running statistics follow the whole
            mini-batch rather than each micro-batch.
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int] | None = None,
                 devices: Sequence[Any] | None = None, chunks: int = 1, checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False) -> None:
        # positional after ``balance`` too, as FairScale's documented signature reads
        super().__init__()
        if balance is None:
            raise ValueError("balance is required: give layers per partition, e.g. balance=[2, 2], or compute it "
                             "with fairscale.nn.pipe.balance.balance_by_time / balance_by_size")
        if not isinstance(module, nn.Sequential):
            raise TypeError("module must be nn.Sequential to be partitioned")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
            raise ValueError(f"number of chunks must be positive integer, got {chunks!r}")
        if checkpoint not in _CHECKPOINT_MODES:
            raise ValueError(f"checkpoint is not one of 'always', 'except_last', or 'never', got {checkpoint!r}")
        balance = list(balance)
        if any(not isinstance(b, int) or b <= 0 for b in balance):
            raise BalanceError(f"all balance numbers must be positive integer (balance: {balance})")
        if sum(balance) != len(module):
            raise BalanceError(f"module and sum of balance have different length "
                               f"(module: {len(module)}, sum of balance: {sum(balance)})")
        children = list(module.children())
        if len({id(c) for c in children}) != len(children):
            raise ValueError("module with duplicate children is not supported")
        verify_skippables(module)
        devs = [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
                for d in (devices if devices is not None else _default_devices(len(balance)))]
        if len(devs) < len(balance):
            raise BalanceError(f"too few devices to hold given partitions (devices: {len(devs)}, "
                               f"partitions: {len(balance)})")
        for d in devs:
            if d.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {d} was given but CUDA is not available; use devices=['cpu'] * "
                                 f"{len(balance)} (or leave devices unset)")
        if deferred_batch_norm:
            DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)  # replaces children in place
        self.balance = balance
        self.devices = devs[:len(balance)]
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norm = deferred_batch_norm
        self.partitions = nn.ModuleList(_split_module(module, balance))
        for part, dev in zip(self.partitions, self.devices):
            part.to(dev)
        self._layers = list(module.children())

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, index: int) -> nn.Module:
        return self._layers[index]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._layers)

    def _checkpoint_stop(self, chunks: int) -> int:
        """Micro-batches ``0 .. stop-1`` are checkpointed."""
        if not self.training or not torch.is_grad_enabled():
            return 0
        return {"always": chunks, "except_last": chunks - 1, "never": 0}[self.checkpoint]

    def forward(self, input: Any) -> Any:  # noqa: A002 - FairScale's argument name
        """Run the mini-batch through the pipeline; returns the output on the last device.

        ``input`` is a tensor or a tuple of tensors; a partition receives what the previous one
        returned (a tensor, or a tuple as one argument), as in ``nn.Sequential``.
        """
        is_tuple = isinstance(input, tuple)
        batches: list[Any] = [b if is_tuple else b[0] for b in _scatter(_as_tuple(input), self.chunks)]
        m, n = len(batches), len(self.partitions)
        stop = self._checkpoint_stop(m)
        trackers = [SkipTracker(keep_popped=True) for _ in range(m)]
        for clock in range(m + n - 1):
            for i in range(max(0, clock - n + 1), min(clock, m - 1) + 1):
                j = clock - i
                batches[i] = self._run_cell(j, batches[i], trackers[i], checkpointed=i < stop)
        if isinstance(batches[0], tuple):
            return tuple(torch.cat([b[k] for b in batches]) for k in range(len(batches[0])))
        return torch.cat(batches)

    def _run_cell(self, j: int, value: Any, tracker: SkipTracker, *, checkpointed: bool) -> Any:
        partition = self.partitions[j]
        device = self.devices[j]
        was_tuple = isinstance(value, tuple)
        xs = tuple(t.to(device, non_blocking=True) for t in _as_tuple(value))
        calls = [0]

        def run(*xs: torch.Tensor) -> Any:
            calls[0] += 1
            arg = xs if was_tuple else xs[0]
            with use_skip_tracker(tracker):
                # skip tensors stashed on another device follow the layer that pops them
                for key, t in list(tracker.tensors.items()):
                    if isinstance(t, torch.Tensor) and t.device != device:
                        tracker.tensors[key] = t.to(device)
                if calls[0] > 1:  # backward-time recomputation of a checkpointed cell
                    with recomputing():
                        return partition(arg)
                if checkpointed:
                    with checkpointing():
                        return partition(arg)
                return partition(arg)

        if checkpointed:
            return torch_checkpoint(run, *xs, use_reentrant=False)
        return run(*xs)
