"""What planning does to go faster, checked for staying the same: collector thresholds restored,
lazily generated GraphModule code that still runs, and the ATen copy made once per graph."""

from __future__ import annotations

import gc

import torch
import torch.fx

from passes.tp.normalize import to_aten
from planner.capture import capture
from planner.fx_module import graph_module
from planner.gc_budget import fewer_collections


def test_fewer_collections_raises_the_threshold_inside_and_restores_it() -> None:
    before = gc.get_threshold()
    with fewer_collections():
        assert gc.get_threshold()[0] >= 100_000 and gc.get_threshold()[1:] == before[1:]
        with fewer_collections():  # nested (plan_for inside the CLI's)
            pass
        assert gc.get_threshold()[0] >= 100_000
    assert gc.get_threshold() == before
    try:
        with fewer_collections():
            raise ValueError("inside")
    except ValueError:
        pass
    assert gc.get_threshold() == before


def test_a_lazy_graph_module_runs_and_shows_its_code_after_edits() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.lin(x))

    net = Net()
    traced = torch.fx.symbolic_trace(net)
    gm = graph_module(traced, traced.graph, "Net")
    x = torch.randn(4, 3)
    assert torch.equal(gm(x), net(x))
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    relu.target = torch.tanh  # an edit, then recompile(): the new code is what runs and prints
    gm.recompile()
    assert torch.equal(gm(x), torch.tanh(net.lin(x))) and "tanh" in gm.code


def test_to_aten_is_made_once_per_graph_and_again_after_the_graph_changes() -> None:
    from fairscale.testing.models import build

    case = build("gpt")
    graph = capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn, tracer="fx")
    first = to_aten(graph.gm)
    assert first is not graph.gm and to_aten(graph.gm) is first
    out = next(n for n in graph.gm.graph.nodes if n.op == "output")
    with graph.gm.graph.inserting_before(out):
        graph.gm.graph.call_function(torch.ops.aten.clone.default, (out.args[0],))

    def clones(gm: torch.fx.GraphModule) -> int:
        return sum(n.target is torch.ops.aten.clone.default for n in gm.graph.nodes)
    again = to_aten(graph.gm)
    assert again is not first and clones(again) == clones(first) + 1


def test_per_graph_keeps_a_result_while_its_graph_lives_and_never_keeps_the_graph_alive() -> None:
    import weakref

    from passes.graph_utils import per_graph

    calls: list[int] = []

    @per_graph
    def copy_of(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        calls.append(1)
        return torch.fx.GraphModule(gm, gm.graph)

    @per_graph
    def unchanged(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return gm  # as the TP detector's preparation returns an ATen graph without in-place ops

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert copy_of(gm) is copy_of(gm) and len(calls) == 1
    assert unchanged(gm) is gm
    alive = weakref.ref(gm)
    del gm
    gc.collect()
    assert alive() is None, "a cached result kept its graph alive"
