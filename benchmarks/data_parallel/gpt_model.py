"""The benchmark's ~4M-parameter GPT and its batches, loadable without importing ``fairscale``
(the original FairScale 0.4.13 worker runs where ``fairscale`` is the old package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]

SIZES: dict[str, dict[str, int]] = {
    "4m": dict(vocab=4096, seq=128, layers=4, heads=4, dim=256),   # 4.24M parameters
    "tiny": dict(vocab=256, seq=16, layers=2, heads=2, dim=32),
}


def _models_module() -> Any:
    name = "_fs_bench_models"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "fairscale" / "testing" / "models.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def build(size: str) -> Any:
    """A seeded ``Case`` (model, make_batch, loss_fn) of the nanoGPT-style GPT with tied embeddings."""
    models = _models_module()
    return models.build_gpt(0, **SIZES[size])


def batches(case: Any, global_batch: int, count: int = 4) -> list[tuple[torch.Tensor, ...]]:
    return [case.make_batch(i, global_batch) for i in range(count)]
