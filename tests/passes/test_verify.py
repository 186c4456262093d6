"""The pipeline verifier: passes on captured and recomputed graphs, names the node when broken."""

import pytest
import torch

from fairscale.testing.models import build
from passes.insert_recompute import insert_recompute_pass
from passes.verify import VerifyError, verify_pass
from planner.capture import capture
from planner.plan import Plan


@pytest.fixture(scope="module")
def graph():
    case = build("gpt", layers=2)
    return capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn)


def test_captured_and_recomputed_graphs_verify(graph):
    verify_pass(graph.gm)
    verify_pass(insert_recompute_pass(graph.gm, Plan(recompute={"layers.*": "full"})))


def test_a_missing_attribute_and_an_unrecorded_parameter_are_both_reported(graph):
    from passes.graph_utils import clone_graph_module

    gm = clone_graph_module(graph.gm)
    gm.meta.pop("fs_layout", None)
    gm.register_parameter("stray", torch.nn.Parameter(torch.zeros(1)))
    node = next(n for n in gm.graph.nodes if n.op == "get_attr")
    node.target = "model.nowhere"
    with pytest.raises(VerifyError) as info:
        verify_pass(gm, where="after test")
    text = str(info.value)
    assert "graph verification failed after test:" in text
    assert "get_attr target 'model.nowhere' does not exist" in text
    assert "parameter 'stray' has no provenance in gm.meta['fs_layout']" in text
