"""AsyncPipe: a pipeline of processes, one stage per rank (FairScale 0.4.13's ``fairscale.nn.pipe.AsyncPipe``).

Every rank of the pipeline group builds the same ``AsyncPipe`` and calls it on the same input;
rank ``r`` holds the ``balance[r]`` layers of stage ``r`` (layers given as :class:`LazyModule` are
only built there). The mini-batch is cut into ``chunks`` micro-batches::

    pipe = AsyncPipe(model, balance=[2, 2], worker_map=get_worker_map(), chunks=4)
    output = pipe(batch)                 # every rank
    if pipe.final_stage:
        loss_fn(output, target).backward()

The first stage runs every micro-batch forward and sends each output to the next stage; middle
stages receive, run and send on; the last stage receives, runs, and returns the micro-batch outputs
concatenated, as ``nn.Sequential`` would. In training (``train()`` mode with grad enabled) the
first and middle stages' ``forward`` does not return before backward: it waits for each micro-batch's
output gradient from the next stage, backpropagates it through its layers and sends the input
gradients back, so gradients reach every stage's parameters once the last stage's ``backward()``
returns (GPipe order: all forwards, then all backwards). They return their micro-batch outputs
(detached). Messages go over ``torch.distributed.rpc`` to the workers named in ``worker_map``.

Checkpointing (``checkpoint='always' | 'except_last' | 'never'``) works per micro-batch inside each
stage, as in :class:`~fairscale.nn.pipe.Pipe`. Ranks beyond ``len(balance)`` hold nothing
(``pipeline`` is None) and return their input. Not supported (as in 0.4.13): skip connections
across stages, and a module used at several places of the Sequential.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections import OrderedDict
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fairscale.nn.model_parallel.initialize import get_pipeline_parallel_group
from fairscale.nn.pipe import microbatch
from fairscale.nn.pipe.batchnorm import DeferredBatchNorm
from fairscale.nn.pipe.checkpoint import Checkpointing
from fairscale.nn.pipe.microbatch import Batch, TensorOrTensors
from fairscale.nn.pipe.pipe import recommend_auto_balance
from fairscale.nn.pipe.rpc_transport import RpcTransport
from fairscale.nn.pipe.skip.tracker import SkipTracker, use_skip_tracker

__all__ = ["AsyncPipe"]

_PIPE_IDS = itertools.count()
_CHECKPOINT_MODES = ("always", "except_last", "never")


def _layers(module: nn.Sequential | Sequence[Any]) -> list[tuple[str, Any]]:
    if isinstance(module, nn.Sequential):
        return list(module.named_children()) if len(list(module.named_children())) == len(module) else \
            [(str(i), m) for i, m in enumerate(module)]
    return [(str(i), m) for i, m in enumerate(module)]


def _realize(layer: Any) -> nn.Module:
    if isinstance(layer, nn.Module):
        return layer
    if callable(layer):
        return layer()  # a LazyModule (or any constructor)
    raise TypeError(f"a pipe layer must be an nn.Module or a LazyModule, got {type(layer).__name__}")


class _FromPrevStage(torch.autograd.Function):
    """The activations received from the previous stage; their gradients are sent back to it."""

    @staticmethod
    def forward(ctx: Any, phony: torch.Tensor, link: "_Stage", index: int, *received: torch.Tensor) -> Any:
        ctx.link, ctx.index = link, index
        ctx.set_materialize_grads(False)
        outs = tuple(t.clone() for t in received)
        ctx.mark_non_differentiable(*[t for t in outs if not t.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.link.send_prev("grad", ctx.index, list(grads))
        return (None, None, None) + tuple(None for _ in grads)


def _backward(out: Batch, grads: Sequence[torch.Tensor | None]) -> None:
    pairs = [(t, g) for t, g in zip(out, grads) if t.requires_grad and g is not None]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


class _Stage:
    """This rank's stage of the pipeline: its layers and its links to the neighbouring stages."""

    def __init__(self, pipe: "AsyncPipe", partition: nn.Sequential, checkpoint_stop: int,
                 transport: RpcTransport | None) -> None:
        self.pipe = pipe
        self.partition = partition
        self.checkpoint_stop = checkpoint_stop
        self.transport = transport
        self.stage = pipe.group.rank()
        self.stages = len(pipe.balance)

    def _global(self, stage: int) -> int:
        return dist.get_global_rank(self.pipe.group, stage)

    def send_next(self, kind: str, index: int, tensors: Sequence[torch.Tensor | None]) -> None:
        assert self.transport is not None
        self.transport.send(self._global(self.stage + 1), kind, index, tensors)

    def send_prev(self, kind: str, index: int, tensors: Sequence[torch.Tensor | None]) -> None:
        assert self.transport is not None
        self.transport.send(self._global(self.stage - 1), kind, index, tensors)

    def recv(self, kind: str) -> tuple[int, list[torch.Tensor | None]]:
        assert self.transport is not None
        return self.transport.recv(kind)

    def compute(self, batch: Batch, *, checkpoint: bool) -> Batch:
        def run(x: TensorOrTensors) -> TensorOrTensors:
            with use_skip_tracker(SkipTracker()):
                out = self.partition(x)
            if isinstance(out, list):
                raise TypeError("a pipe stage must return a tensor or a tuple of tensors, not a list")
            return out

        if not checkpoint:
            return batch.call(run)
        chk = Checkpointing(run, batch)
        out = chk.checkpoint()
        chk.recompute(out)
        return out

    def run(self, batches: list[Batch]) -> None:
        training = self.partition.training and torch.is_grad_enabled()
        stop = self.checkpoint_stop if training else 0
        m = len(batches)
        if self.stages == 1:
            for i, b in enumerate(batches):
                batches[i] = self.compute(b, checkpoint=i < stop)
            return
        if self.stage == 0:
            outs = {}
            for b in batches:
                out = self.compute(b, checkpoint=b.index < stop)
                self.send_next("act", b.index, list(out))
                outs[b.index] = out
            if training:
                for _ in range(m):
                    index, grads = self.recv("grad")
                    _backward(outs[index], grads)
            for i in range(m):
                batches[i] = Batch(tuple(t.detach() for t in outs[i]) if not outs[i].atomic else outs[i].tensor.detach(), i)
            return
        final = self.stage == self.stages - 1
        kept: dict[int, tuple[list[torch.Tensor], Batch]] = {}
        for _ in range(m):
            index, received = self.recv("act")
            tensors = [t for t in received if t is not None]
            if final:
                phony = torch.empty(0, device=tensors[0].device if tensors else None, requires_grad=torch.is_grad_enabled())
                inputs = list(_FromPrevStage.apply(phony, self, index, *tensors))
            else:
                inputs = [t.requires_grad_(t.is_floating_point() and training) for t in tensors]
            batch = Batch(inputs[0] if len(inputs) == 1 else tuple(inputs), index)
            out = self.compute(batch, checkpoint=index < stop)
            if final:
                batches[index] = out
                continue
            self.send_next("act", index, list(out))
            kept[index] = (inputs, out)
            batches[index] = out
        if final or not training:
            return
        for _ in range(m):
            index, grads = self.recv("grad")
            inputs, out = kept.pop(index)
            _backward(out, grads)
            self.send_prev("grad", index, [t.grad if t.requires_grad else None for t in inputs])


class AsyncPipe(nn.Module):
    """One pipeline stage per rank of ``group`` (see the module docstring).

    Args:
        module: an ``nn.Sequential``, or a list of layers / :class:`LazyModule` s.
        balance: layers per stage (one stage per rank; more ranks than stages: the rest idle).
        group: the pipeline group (default ``get_pipeline_parallel_group()``).
        worker_map: ``{global rank: rpc worker name}`` (required with more than one stage).
        input_device: where received activations are placed (default: the stage's device).
        chunks: micro-batches per mini-batch.
        checkpoint: ``'always'``, ``'except_last'`` or ``'never'``.
        deferred_batch_norm: BatchNorm statistics over the whole mini-batch (see ``DeferredBatchNorm``).
    """

    def __init__(self, module: nn.Sequential | Sequence[Any], balance: Iterable[int], *, group: Any = None,
                 worker_map: dict[int, str] | None = None, input_device: Any = None, chunks: int = 1,
                 checkpoint: str = "except_last", deferred_batch_norm: bool = False) -> None:
        super().__init__()
        chunks, checkpoint = int(chunks), str(checkpoint)
        if chunks <= 0:
            raise ValueError("number of chunks must be positive integer")
        if checkpoint not in _CHECKPOINT_MODES:
            raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")
        self.balance = list(balance)
        layers = _layers(module)
        if len({id(m) for _, m in layers}) != len(layers):
            raise ValueError("module with duplicate children is not supported")
        if len(layers) != sum(self.balance):
            raise ValueError(recommend_auto_balance(f"module and sum of balance have different length "
                                                    f"(module: {len(layers)}, sum of balance: {sum(self.balance)})"))
        if any(b <= 0 for b in self.balance):
            raise ValueError(f"all balance numbers must be positive integer (balance: {self.balance})")
        self.chunks, self.checkpoint = chunks, checkpoint
        self.group = group if group is not None else get_pipeline_parallel_group()
        if self.group.size() < len(self.balance):
            raise IndexError(f"too few ranks to hold given partitions (ranks: {self.group.size()}, partitions: "
                             f"{len(self.balance)})")
        self.worker_map = worker_map
        self.input_device = input_device
        self.lock = threading.Lock()
        self.pipe_id = next(_PIPE_IDS)  # the same on every rank: all build their pipes in the same order
        rank = self.group.rank()
        self.final_stage = rank == len(self.balance) - 1
        self.pipeline: _Stage | None = None
        if rank >= len(self.balance):
            warnings.warn("More ranks than partitions, some ranks unused")
            return
        start = sum(self.balance[:rank])
        partition: nn.Module = nn.Sequential(OrderedDict((name, _realize(layer))
                                                         for name, layer in layers[start:start + self.balance[rank]]))
        if deferred_batch_norm:
            partition = DeferredBatchNorm.convert_deferred_batch_norm(partition, chunks)
        self.add_module("0", partition)
        param = next(partition.parameters(), None)
        device = torch.device(input_device) if input_device is not None else \
            (param.device if param is not None else torch.device("cpu"))
        transport = RpcTransport(worker_map, self.pipe_id, device) if len(self.balance) > 1 else None
        stop = {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]
        self.pipeline = _Stage(self, partition, stop, transport)  # type: ignore[arg-type]

    @property
    def partition(self) -> nn.Sequential | None:
        """This rank's layers (None on a rank without a stage)."""
        return self._modules.get("0")  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self.partition) if self.partition is not None else 0

    def __getitem__(self, index: int) -> nn.Module:
        if self.partition is None:
            raise IndexError("this rank holds no stage")
        return self.partition[index]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.partition) if self.partition is not None else iter(())

    def forward(self, input: TensorOrTensors, *, event: Any = None) -> Any:  # noqa: A002
        """Run this rank's stage on every micro-batch (see the module docstring); the last stage
        returns the output, the others their micro-batch outputs. ``event`` is accepted for
        :class:`PipeRPCWrapper` (the first stage waits on its gradient messages instead)."""
        microbatch.check(input)
        if self.pipeline is None:
            return input
        batches = microbatch.scatter(input, self.chunks)
        with self.lock:
            self.pipeline.run(batches)
        return microbatch.gather(batches) if self.final_stage else batches

    def back_helper(self, output: list[Batch]) -> None:
        """Kept from 0.4.13: the non-final stages' backward already ran inside ``forward``."""
        if self.final_stage:
            raise ValueError("back_helper should only be called on non-final stages")
