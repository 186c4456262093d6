"""The detector checks its proposals on a graph with the exact copies among repeated layers
dropped (``passes.tp.representative``): it must propose what a check of the whole graph proposes,
for every family with repeated layers and at every degree, including when one layer differs."""

from __future__ import annotations

import pytest
import torch

import passes.tp.patterns as patterns
from fairscale.testing.models import build
from passes.tp.representative import representative
from planner.capture import capture
from planner.graph import META_LAYER

CASES = {  # name: (family, overrides, edit of the built model)
    "gpt": ("gpt", dict(layers=6, dim=96), None),
    "gpt, layer 4 with 6 heads": ("gpt", dict(layers=6, dim=96), lambda m: setattr(m.layers[4].attn, "heads", 6)),
    "llama (GQA)": ("llama", dict(layers=5), None),
    "gpt2 (fused qkv, Conv1D)": ("gpt2", dict(layers=4), None),
    "mixtral (routed experts)": ("mixtral", dict(layers=4), None),
}


def _graph(name: str) -> torch.fx.GraphModule:
    family, over, edit = CASES[name]
    case = build(family, **over)
    if edit is not None:
        edit(case.model)
    return capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn).gm


def _layers(gm: torch.fx.GraphModule) -> set[str]:
    return {n.meta[META_LAYER] for n in gm.graph.nodes if n.op == "call_function" and n.meta.get(META_LAYER)}


@pytest.mark.parametrize("name", list(CASES))
def test_proposals_checked_on_the_small_graph_equal_those_checked_on_the_whole(name: str, monkeypatch) -> None:
    gm = _graph(name)
    small = representative(patterns._prepared(gm))
    assert len(small.graph.nodes) < len(patterns._prepared(gm).graph.nodes)  # something repeats: it shrank
    fast = {tp: patterns.propose_tp_rules(gm, tp=tp) for tp in (8, 4, 2)}
    patterns._ACCEPTED.clear()
    monkeypatch.setattr(patterns, "_representative", lambda g: g)  # check on the whole graph
    for tp in (8, 4, 2):
        whole = patterns.propose_tp_rules(gm, tp=tp)
        assert (fast[tp].rules, fast[tp].refused, fast[tp].notes) == (whole.rules, whole.refused, whole.notes), tp


def test_the_copies_are_dropped_and_a_layer_that_differs_is_kept() -> None:
    uniform = representative(patterns._prepared(_graph("gpt")))
    assert {n for n in _layers(uniform) if n.startswith("layers.")} == {"layers.0", "layers.1"}
    odd = representative(patterns._prepared(_graph("gpt, layer 4 with 6 heads")))
    # 2 and 3 copy layer 1; layer 4 differs, so it and what follows it stay
    assert {n for n in _layers(odd) if n.startswith("layers.")} == {"layers.0", "layers.1", "layers.4", "layers.5"}
    refused = patterns.propose_tp_rules(_graph("gpt, layer 4 with 6 heads"), tp=4).refused
    assert any("layers.4" in path for path in refused), refused
