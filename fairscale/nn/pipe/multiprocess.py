"""Pipe across processes: each rank of a pipeline group runs its partitions of an ``nn.Sequential``.

Built on the compiler's pipeline runtime, not on a second one: the Sequential and its loss are
captured (``planner.capture``), cut into stages by ``balance`` (``passes.split_stages``), and run
by :class:`fairscale.runtime.pipeline.PipelineExecutor` under a schedule from
``planner.schedule`` (GPipe, 1F1B or interleaved 1F1B), with batched, untagged point-to-point
between neighbouring ranks (``fairscale.runtime.p2p``).

    # every rank (fairscale.launch or torchrun), pipeline of 2 ranks:
    pipe = MultiProcessPipe(nn.Sequential(a, b, c, d), balance=[2, 2], chunks=4,
                            loss_fn=F.cross_entropy, example_batch=(x, y), schedule="1f1b")
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)       # this rank's partitions only
    for x, y in data:                                          # every rank loads the same batch
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)        # forward + backward of all micro-batches; mean loss on every rank
        opt.step()

The interface is a training step rather than FairScale's ``forward`` on the last rank: a
schedule interleaves forwards and backwards of different micro-batches (1F1B), which a
``forward()`` followed by a user ``backward()`` cannot express. Every rank passes the same
batch; the first stage reads the inputs and the last the targets (no labels travel down the
pipe). Parameters live in the stage modules (copies of the Sequential's); read them back with
:meth:`state_dict`, keyed like the Sequential's own ``state_dict``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fairscale.optim.oss import axis_for_group
from fairscale.runtime.pipeline import PipelineExecutor
from passes.ops import comm
from passes.split_stages import split_stages_pass
from planner.capture import capture
from planner.plan import Mesh, Plan, Schedule, Stage
from planner.schedule import build_schedule

__all__ = ["MultiProcessPipe"]

_SCHEDULES = ("gpipe", "1f1b", "interleaved")


class MultiProcessPipe:
    """Pipeline-parallel training of an ``nn.Sequential`` over the ranks of ``group``.

    Args:
        module: the ``nn.Sequential`` (identical on every rank, e.g. built from the same seed).
        balance: layers per stage; ``len(balance)`` = ranks × ``virtual_stages``. Stage ``s`` runs
            on pipeline rank ``s % ranks``.
        chunks: micro-batches per step (the batch's dim 0 must divide by it).
        loss_fn: ``loss_fn(module(inputs), *targets)``, computed on the last stage.
        example_batch: a mini-batch ``(inputs, *targets)`` of the shape :meth:`step` will get.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (needs ``virtual_stages`` > 1).
        virtual_stages: stages per rank for the interleaved schedule.
        group: the pipeline process group (default: the world).
        checkpoint: only ``"never"``: activation checkpointing of stage cells is not available on
            this runtime (use the single-process :class:`Pipe` for it).
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int], *, chunks: int,
                 loss_fn: Callable[..., torch.Tensor], example_batch: Sequence[torch.Tensor],
                 schedule: str = "gpipe", virtual_stages: int = 1, group: Any = None,
                 checkpoint: str = "never") -> None:
        if not isinstance(module, nn.Sequential):
            raise TypeError("module must be nn.Sequential to be partitioned")
        if checkpoint != "never":
            raise NotImplementedError(f"MultiProcessPipe(checkpoint={checkpoint!r}) is not supported: the "
                                      "pipeline runtime keeps every activation; use checkpoint='never', or "
                                      "the single-process fairscale.nn.Pipe for activation checkpointing")
        if schedule not in _SCHEDULES:
            raise ValueError(f"schedule must be one of {_SCHEDULES}, got {schedule!r}")
        if not dist.is_initialized():
            raise RuntimeError("MultiProcessPipe needs torch.distributed initialized (fairscale.launch or torchrun)")
        self.axis = axis_for_group(group, prefix="pipe")
        ranks = comm.group_size(self.axis)
        balance = list(balance)
        if any(not isinstance(b, int) or b <= 0 for b in balance):
            raise ValueError(f"all balance numbers must be positive integer (balance: {balance})")
        if sum(balance) != len(module):
            raise ValueError(f"module and sum of balance have different length "
                             f"(module: {len(module)}, sum of balance: {sum(balance)})")
        if len(balance) != ranks * virtual_stages:
            raise ValueError(f"balance has {len(balance)} stages but the pipeline group has {ranks} ranks × "
                             f"virtual_stages({virtual_stages}) = {ranks * virtual_stages}")
        if (schedule == "interleaved") != (virtual_stages > 1):
            raise ValueError("the interleaved schedule needs virtual_stages > 1, and only it can use them")
        batch = tuple(example_batch)
        if batch[0].shape[0] % chunks:
            raise ValueError(f"batch size {batch[0].shape[0]} is not divisible by chunks={chunks}")
        micro = tuple(t.chunk(chunks)[0] for t in batch)
        graph = capture(module, micro, loss_fn=loss_fn, annotate=False)
        stages = self._stages(graph, balance)
        plan = Plan(mesh=Mesh(pp=ranks), schedule=Schedule(kind=schedule, microbatches=chunks,
                                                           virtual_stages=virtual_stages),
                    stages=[Stage(layers=", ".join(names)) for names in stages])
        self.program = split_stages_pass(graph.gm, plan, graph=graph)
        self.schedule = build_schedule(schedule, pp=ranks, microbatches=chunks, virtual_stages=virtual_stages)
        self.executor = PipelineExecutor(self.program, self.schedule, axis=self.axis, no_sync=_no_sync)
        self.balance, self.chunks = balance, chunks

    @staticmethod
    def _stages(graph: Any, balance: list[int]) -> list[list[str]]:
        """Captured layer names per stage: a layer belongs to the top-level child it lives in."""
        bounds, start = [], 0
        for b in balance:
            bounds.append(range(start, start + b))
            start += b
        out: list[list[str]] = [[] for _ in balance]
        for layer in graph.layers:
            child = int(layer.name.split(".")[0])
            out[next(s for s, r in enumerate(bounds) if child in r)].append(layer.name)
        empty = [s for s, names in enumerate(out) if not names]
        if empty:
            raise ValueError(f"stages {empty} hold no computation (only parameter-free identity layers?); "
                             f"move layers so that every stage computes something (balance: {balance})")
        return out

    def step(self, *batch: torch.Tensor) -> float:
        """Forward and backward of the mini-batch over all micro-batches; returns the mean loss.

        Gradients accumulate into :meth:`parameters` (zero them between steps)."""
        return self.executor.step(batch)

    def parameters(self) -> Iterator[nn.Parameter]:
        """Trainable parameters of this rank's stages."""
        return self.executor.parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers, keyed as in the Sequential's ``state_dict``."""
        return self.executor.state_dict()


def _no_sync() -> Any:
    import contextlib

    return contextlib.nullcontext()
