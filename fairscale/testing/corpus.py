"""The real-model conformance corpus: unmodified architectures, as users write them.

Each entry builds a model exactly as its library or codebase defines it, with the library's
DEFAULT configuration values shrunk in size only (layers, widths, heads, vocabulary, positions)
and dropout off (a parallel run can match one process only without random masks). The corpus
runner (:mod:`fairscale.testing.corpus_run`) plans each model through the public API, trains it
under several plans on CPU ranks and compares with one process; a (model, plan) pair is exact or
refused before launch, never different and never a crash after launch.

Two sources fill the registry, each a module exporting ``MODELS: dict[str, CorpusModel]``:

* :mod:`fairscale.testing.corpus_hf`: Hugging Face ``transformers`` models with default configs.
* :mod:`fairscale.testing.corpus_styles`: plain PyTorch models and models written in the styles
  of independent codebases (fused QKV, ``x * x`` norms, ``flatten(0, 1)`` losses, BatchNorm,
  in-place ops, tied weights, data-dependent routing).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from fairscale.testing.models import Case

__all__ = ["CorpusModel", "models", "SOURCES"]

SOURCES = ("fairscale.testing.corpus_hf", "fairscale.testing.corpus_styles")
"""The modules whose ``MODELS`` make up the corpus."""


@dataclass(frozen=True, kw_only=True)
class CorpusModel:
    name: str
    """Unique short name, e.g. ``"hf-llama"`` or ``"nanogpt"``: the row of the result table."""
    build: Callable[[int], Case]
    """``build(seed)`` -> a freshly initialized :class:`Case` (model, batch maker, loss convention)."""
    origin: str
    """Where the code comes from, e.g. ``"transformers LlamaForCausalLM, default LlamaConfig"``."""
    features: str = ""
    """What the model exercises that others do not (fused QKV, BatchNorm, in-place add, ...)."""
    default_tier: bool = False
    """True for the representative subset that runs in the default test tier; the rest is slow tier."""


def models() -> dict[str, CorpusModel]:
    """Every corpus model, by name, from every module in :data:`SOURCES` (a missing optional
    dependency, e.g. ``transformers``, leaves that module's models out)."""
    out: dict[str, CorpusModel] = {}
    for source in SOURCES:
        try:
            module = importlib.import_module(source)
        except ModuleNotFoundError as e:
            if e.name == source:
                continue
            raise
        for name, entry in module.MODELS.items():
            if name in out:
                raise ValueError(f"corpus model {name!r} is defined twice ({source} and an earlier source)")
            out[name] = entry
    return out
