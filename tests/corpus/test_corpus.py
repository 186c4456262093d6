"""The real-model conformance corpus (issue 12): every (model, plan) trains exactly or is refused
before launch with a message that says where and what to do; never a different number, never a
crash after launch.

The registry (``fairscale.testing.corpus``) holds Hugging Face models with default configs
(``corpus_hf``) and plain-PyTorch / independent-codebase-style models (``corpus_styles``). Each
model runs under every plan kind of ``corpus_run.PLANS`` (the searched plan, a forced pp2 x tp2,
data parallel over 4 ranks in 2 microbatches) on 4 gloo ranks, 3 SGD steps, against one process.
The default tier runs the models marked ``default_tier`` (a representative subset of both
sources, in one launch); ``-m slow`` runs the rest. ``benchmarks/corpus/run.py`` regenerates the
README's table from the same runner.
"""

from __future__ import annotations

import importlib

import pytest

from fairscale.compile_check import Refusal
from fairscale.testing.corpus import SOURCES, models
from fairscale.testing.corpus_run import PLANS, Result, refusal_gaps, run_cases

REGISTRY = models()
DEFAULT = tuple(n for n, m in REGISTRY.items() if m.default_tier)
SLOW = tuple(n for n in REGISTRY if n not in DEFAULT)
TARGET = 30
"""Models the corpus must reach once both sources exist (issue 12: at least 30 architectures)."""

_RUNS: dict[tuple[str, ...], dict[tuple[str, str], Result]] = {}


def _result(tier: tuple[str, ...], name: str, plan: str) -> Result:
    if tier not in _RUNS:  # one launch for the whole tier
        _RUNS[tier] = {(r.model, r.plan): r for r in run_cases(tier, tuple(PLANS))}
    return _RUNS[tier][(name, plan)]


def _check(result: Result) -> None:
    assert result.outcome in ("exact", "refused"), result.describe()
    assert result.ok, f"the refusal's message lacks {result.gaps}:\n{result.detail}"


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", DEFAULT)
def test_default_tier(name: str, plan: str) -> None:
    _check(_result(DEFAULT, name, plan))


@pytest.mark.slow
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", SLOW)
def test_slow_tier(name: str, plan: str) -> None:
    _check(_result(SLOW, name, plan))


def test_registry_size_and_default_tier_span() -> None:
    """At least 16 Hugging Face models; with the second source present, at least 30 in all, and
    the default tier samples every source that is present."""
    present = {}
    for source in SOURCES:
        try:
            present[source] = importlib.import_module(source).MODELS
        except ModuleNotFoundError as e:
            if e.name != source:
                raise
    assert len(present["fairscale.testing.corpus_hf"]) >= 16
    if len(present) == len(SOURCES):
        assert len(REGISTRY) >= TARGET, f"{len(REGISTRY)} corpus models, the target is {TARGET}"
    for source, entries in present.items():
        assert any(m.default_tier for m in entries.values()), f"{source} has no model in the default tier"


def test_refusal_gaps_name_what_a_message_lacks() -> None:
    full = Refusal(reason="TPShardError: in-place add_ would need its input converted", pass_name="the TP pass",
                   module="layers.0.mlp", op="aten.add_.Tensor", source="model.py:42 in forward: x += y",
                   hint="set tensor_parallel.rules for layers.0.mlp to replicate").message()
    assert refusal_gaps(full) == []
    assert refusal_gaps("no plan fits in memory") == ["module", "op", "source line", "what to do"]
    assert refusal_gaps(full.replace("model.py:42", "model.py")) == ["source line"]
