"""Checkpointing of one Pipe cell (a micro-batch through a partition), torchgpipe-style.

Unlike ``torch.utils.checkpoint``, the recomputation is a separate node in the autograd graph,
so the pipeline can schedule it: the cell's forward runs as ``Checkpoint`` (no activations kept),
and ``Recompute`` is joined to the cell's *output* so that, in backward, it re-runs the forward
just before the gradient reaches ``Checkpoint``, which then backpropagates through the recomputed
graph::

    chk = Checkpointing(function, batch)
    batch = chk.checkpoint()     # forward without keeping activations
    chk.recompute(batch)         # schedules the recomputation in backward (joined to batch[0])

The RNG state is saved at the first pass and restored for the recomputation (same dropout
masks). :func:`is_checkpointing` / :func:`is_recomputing` tell a layer which pass it is in.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import Any, Deque, Iterator

import torch

from fairscale.nn.pipe.dependency import fork, join
from fairscale.nn.pipe.microbatch import Batch, Function, Tensors, TensorOrTensors
from fairscale.nn.pipe.phony import get_phony

__all__ = ["is_checkpointing", "is_recomputing", "enable_checkpointing", "enable_recomputing", "Checkpointing",
           "Checkpoint", "Recompute", "Function", "TensorOrTensors", "Tensors", "save_rng_states",
           "restore_rng_states"]

# what a recomputation leaves for its Checkpoint's backward: (output, detached input leaves)
Recomputed = tuple[TensorOrTensors, Tensors]
RNGStates = tuple[torch.Tensor, Any]  # (CPU state, CUDA state or None)


class _Flags(threading.local):
    checkpointing = False
    recomputing = False


_FLAGS = _Flags()


@contextlib.contextmanager
def _flag(name: str) -> Iterator[None]:
    old = getattr(_FLAGS, name)
    setattr(_FLAGS, name, True)
    try:
        yield
    finally:
        setattr(_FLAGS, name, old)


def enable_checkpointing() -> contextlib.AbstractContextManager[None]:
    """:func:`is_checkpointing` is True inside."""
    return _flag("checkpointing")


def enable_recomputing() -> contextlib.AbstractContextManager[None]:
    """:func:`is_recomputing` is True inside."""
    return _flag("recomputing")


def is_checkpointing() -> bool:
    """True while a checkpointed cell runs its first forward (activations are not kept)."""
    return _FLAGS.checkpointing


def is_recomputing() -> bool:
    """True while a checkpointed cell's forward re-runs in backward; skip one-time side effects
    (counters, running statistics) when it is."""
    return _FLAGS.recomputing


class Checkpointing:
    """Checkpoints ``function`` on ``batch`` (see the module docstring)."""

    def __init__(self, function: Function, batch: Batch) -> None:
        self.function = function
        self.batch = batch
        # Checkpoint and Recompute hand each other the recomputed graph and the RNG state
        self.recomputed: Deque[Recomputed] = deque(maxlen=1)
        self.rng_states: Deque[RNGStates] = deque(maxlen=1)

    def checkpoint(self) -> Batch:
        """Run the forward without keeping activations; the output requires grad (through a phony)."""
        phony = get_phony(self.batch[0].device, requires_grad=True)
        output = Checkpoint.apply(phony, self.recomputed, self.rng_states, self.function, self.batch.atomic,
                                  *self.batch)
        if isinstance(output, tuple):  # non-float outputs cannot carry gradients
            output = tuple(x if x.is_floating_point() else x.detach() for x in output)
        return Batch(output, self.batch.index)

    def recompute(self, batch: Batch) -> None:
        """Join the recomputation to ``batch`` (the checkpointed output) in the autograd graph."""
        batch[0], phony = fork(batch[0])
        phony = Recompute.apply(phony, self.recomputed, self.rng_states, self.function, self.batch.atomic,
                                *self.batch)
        batch[0] = join(batch[0], phony)


def save_rng_states(device: torch.device, rng_states: Deque[RNGStates]) -> None:
    """Push the CPU RNG state (and ``device``'s, for CUDA) for :func:`restore_rng_states`."""
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    rng_states.append((torch.get_rng_state(), cuda_state))


@contextlib.contextmanager
def restore_rng_states(device: torch.device, rng_states: Deque[RNGStates]) -> Iterator[None]:
    """Run the block with the RNG states :func:`save_rng_states` pushed; restore the current ones after."""
    cpu_state, cuda_state = rng_states.pop()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        yield


def _call(function: Function, atomic: bool, inputs: tuple[torch.Tensor, ...]) -> TensorOrTensors:
    return function(inputs[0] if atomic else inputs)


class Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, phony: torch.Tensor, recomputed: Deque[Recomputed], rng_states: Deque[RNGStates],
                function: Function, input_atomic: bool, *input: torch.Tensor) -> TensorOrTensors:  # noqa: A002
        ctx.recomputed = recomputed
        ctx.rng_states = rng_states
        save_rng_states(input[0].device, rng_states)
        ctx.function = function
        ctx.input_atomic = input_atomic
        ctx.save_for_backward(*input)
        with torch.no_grad(), enable_checkpointing():
            return _call(function, input_atomic, input)

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple[Any, ...]:
        output, input_leaf = ctx.recomputed.pop()
        outputs = (output,) if torch.is_tensor(output) else output
        pairs = [(y, g) for y, g in zip(outputs, grad_output) if y.requires_grad]
        if pairs:
            torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
        return (None, None, None, None, None) + tuple(x.grad for x in input_leaf)


class Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, phony: torch.Tensor, recomputed: Deque[Recomputed], rng_states: Deque[RNGStates],
                function: Function, input_atomic: bool, *input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        ctx.recomputed = recomputed
        ctx.rng_states = rng_states
        ctx.function = function
        ctx.input_atomic = input_atomic
        ctx.save_for_backward(*input)
        return phony

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple[Any, ...]:
        inputs = ctx.saved_tensors
        leaves = tuple(x.detach().requires_grad_(x.requires_grad) for x in inputs)
        with restore_rng_states(inputs[0].device, ctx.rng_states), torch.enable_grad(), enable_recomputing():
            output = _call(ctx.function, ctx.input_atomic, leaves)
        ctx.recomputed.append((output, leaves))
        return (None, None, None, None, None) + tuple(None for _ in inputs)
