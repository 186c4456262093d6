"""Random-number streams for model parallelism (FairScale/Megatron ``model_parallel.random``).

Dropout inside a tensor-parallel region must differ across model-parallel ranks (each holds
different activations), while everything else must draw the same numbers on every rank.
``model_parallel_cuda_manual_seed(seed)`` seeds the default generator with ``seed`` everywhere and
a tracked stream with ``seed + 2718 + model_parallel_rank`` (Megatron-LM's offsets); code draws
from the tracked stream inside ``get_cuda_rng_tracker().fork()``::

    model_parallel_cuda_manual_seed(1234)
    with get_cuda_rng_tracker().fork():
        x = F.dropout(x_parallel, 0.1)      # different mask on each model-parallel rank

The "cuda" names are FairScale's; the streams are the CUDA generator when CUDA is available and
the CPU generator otherwise, so the same code runs on CPU-only machines.
"""

from __future__ import annotations

import contextlib
from typing import Generator

import torch

from fairscale.nn.model_parallel.initialize import get_model_parallel_rank

__all__ = ["CudaRNGStatesTracker", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed",
           "MODEL_PARALLEL_RNG_TRACKER_NAME"]

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named generator states; ``fork(name)`` runs a block on that stream and advances it."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        self.states.clear()
        self.seeds.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        self.seeds.add(seed)
        saved = _get_state()
        _manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME) -> Generator[None, None, None]:
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} is not added; call model_parallel_cuda_manual_seed(seed) first")
        saved = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(saved)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default stream with ``seed`` and the model-parallel stream with
    ``seed + 2718 + model_parallel_rank`` (Megatron-LM's ``model_parallel_cuda_manual_seed``)."""
    _TRACKER.reset()
    _manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + get_model_parallel_rank())
