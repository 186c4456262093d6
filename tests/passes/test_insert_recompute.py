"""Recompute pass: same numbers, fewer saved activations, and the structure it promises."""

import pytest
import torch

from fairscale.runtime.memory import SavedActivationMeter
from fairscale.testing.models import build
from passes.insert_recompute import insert_recompute_pass, recompute_call
from planner.capture import capture
from planner.plan import Plan


def _run(gm, batch):
    params = list(gm.parameters())
    for p in params:
        p.grad = None
    with SavedActivationMeter(params) as meter:
        loss = gm(*batch)
    held = meter.bytes(exclude=[loss])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in gm.named_parameters()}
    return loss.item(), grads, held


@pytest.fixture(scope="module", params=["gpt", "llama"])
def captured(request):
    case = build(request.param)
    batch = case.make_batch(0, 4)
    return capture(case.model, batch, loss_fn=case.loss_fn), batch


@pytest.mark.parametrize("kind", ["full", "selective"])
def test_recompute_keeps_loss_and_gradients_and_saves_less(captured, kind):
    graph, batch = captured
    loss0, grads0, saved0 = _run(graph.gm, batch)
    gm = insert_recompute_pass(graph.gm, Plan(recompute={"layers.*": kind}))
    loss1, grads1, saved1 = _run(gm, batch)
    assert loss1 == loss0
    for name, g in grads0.items():
        torch.testing.assert_close(grads1[name], g, rtol=0, atol=1e-6)
    assert saved1 < saved0 * (0.5 if kind == "full" else 0.9), (saved0, saved1)


def test_one_recompute_region_per_selected_layer(captured):
    graph, _ = captured
    layers = [l.name for l in graph.layers if l.name.split(".")[-2:-1] == ["layers"]]
    gm = insert_recompute_pass(graph.gm, Plan(recompute={"layers.[0-1]": "full", "layers.1": "none"}))
    calls = [n for n in gm.graph.nodes if n.target is recompute_call]
    assert [n.meta["fs_layer"] for n in calls] == [layers[0]]
    assert calls[0].args[1] == "full"
    # parameter-only nodes stay outside the region: the region's inputs include the layer's weights
    assert any(a.op == "get_attr" for a in calls[0].args[2:])
    assert not any(n.op == "get_attr" for n in gm.get_submodule(calls[0].args[0].target).graph.nodes)


def test_no_recompute_rules_leave_the_graph_untouched(captured):
    graph, _ = captured
    assert insert_recompute_pass(graph.gm, Plan()) is graph.gm
