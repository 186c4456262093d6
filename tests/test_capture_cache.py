"""The rank capture cache (``fairscale.capture_cache``): ranks reuse the capture the plan-time
compile check made, and nothing that changes the graph ever gets an old capture."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import fairscale
from fairscale.testing.reference import start_again
import fairscale.capture_cache as cache
from fairscale.capture_cache import model_state, rank_capture
from fairscale.compile_check import checker_for
from fairscale.testing.models import build
from planner.plan import DataParallel, Mesh, Plan, Schedule


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.0)
        self.fc2 = nn.Linear(16, 4)
        self.act = torch.relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.act(self.fc1(x))))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def _batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 8), torch.randint(0, 4, (rows,))


def _dropout_p(graph) -> list[float]:
    return [n.args[1] for n in graph.gm.graph.nodes if n.op == "call_function" and "dropout" in str(n.target)]


def test_the_same_model_and_shapes_give_the_same_capture_sharing_the_weights() -> None:
    model = Net()
    graph = rank_capture(model, _batch(4), loss_fn=_loss)
    assert rank_capture(model, _batch(4), loss_fn=_loss) is graph  # other values, same shapes
    mine = {id(t) for t in [*model.parameters(), *model.buffers()]}
    assert {id(t) for t in [*graph.gm.parameters(), *graph.gm.buffers()]} <= mine, "the capture copied a weight"
    with torch.no_grad():
        model.fc1.weight.add_(1.0)  # new values: the capture holds the same tensor, nothing to go stale
    assert rank_capture(model, _batch(4), loss_fn=_loss) is graph


@pytest.mark.parametrize("change", ["shape", "dtype", "loss", "eval", "dropout p", "new submodule", "to float64",
                                    "frozen", "hook", "config flag", "function"])
def test_anything_that_changes_the_graph_captures_again(change: str) -> None:
    model = Net()
    model.config = type("Config", (), {})()
    model.config.use_cache = True
    batch, loss = _batch(4), _loss
    before = rank_capture(model, batch, loss_fn=loss)
    if change == "shape":
        batch = _batch(2)
    elif change == "dtype":
        batch = (batch[0].double(), batch[1])
        model.double()
    elif change == "loss":
        loss = lambda out, y: nn.functional.cross_entropy(out, y) * 2  # noqa: E731
    elif change == "eval":
        model.eval()
    elif change == "dropout p":
        model.drop.p = 0.5
    elif change == "new submodule":
        model.fc2 = nn.Linear(16, 4)
    elif change == "to float64":
        model.double()
        batch = (batch[0].double(), batch[1])
    elif change == "frozen":
        model.fc1.weight.requires_grad_(False)
    elif change == "hook":
        model.fc1.register_forward_hook(lambda mod, args, out: out * 2)
    elif change == "config flag":
        model.config.use_cache = False
    elif change == "function":
        model.act = torch.tanh
    after = rank_capture(model, batch, loss_fn=loss)
    assert after is not before
    if change == "dropout p":  # the new capture has the new graph, not merely a new object
        assert _dropout_p(before) == [0.0] and _dropout_p(after) == [0.5]
    if change == "function":
        assert any("tanh" in str(n.target) for n in after.gm.graph.nodes)
    if change == "hook":
        assert len([n for n in after.gm.graph.nodes if "mul" in str(n.target)]) > \
               len([n for n in before.gm.graph.nodes if "mul" in str(n.target)])
    if change == "new submodule":
        assert model.fc2.weight in set(after.gm.parameters())


def test_the_state_is_stable_and_entries_go_with_their_model() -> None:
    case = build("gpt", layers=2)
    assert model_state(case.model) == model_state(case.model)
    rank_capture(case.model, case.make_batch(0, 4), loss_fn=case.loss_fn)
    mine = [key for key in cache._CAPTURES if key[0] == id(case.model)]
    assert mine and model_state(case.model) == mine[0][3], "capturing changed the model's state"
    del case
    gc.collect()
    assert not any(key in cache._CAPTURES for key in mine), "a dead model's capture goes (its address may be reused)"


def test_the_compile_check_and_the_ranks_share_one_capture() -> None:
    """The check captures at the microbatch shape; ranks forked afterwards compile that capture
    and export nothing (capturing raises in them)."""
    case = build("gpt", layers=2)
    batch = case.make_batch(0, 8)
    plan = Plan(mesh=Mesh(dp=2), schedule=Schedule(microbatches=2, global_batch=8),
                data_parallel=DataParallel(kind="ddp"))
    checker = checker_for(case.model, batch, loss_fn=case.loss_fn)
    assert checker.refusal(plan) is None
    graph = checker.graph_for(plan)
    assert rank_capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn) is graph
    fairscale.api.captured(case.model, batch, loss_fn=case.loss_fn)  # the plan's own capture, as a search makes

    def rank(rank: int, world: int) -> float:
        import planner.capture

        def no_trace(*args, **kwargs):
            raise AssertionError("a rank traced the model the parent had captured")

        planner.capture.export_trace = planner.capture.fx_trace = no_trace
        pm = fairscale.parallelize(case.model, example_inputs=batch, loss_fn=case.loss_fn, plan=plan)
        loss = pm.train_step(batch)
        # the model is now guarded (and behind its ranks): a second plan of it, as the corpus's
        # ranks make, still finds the capture (the guard's hook changes no graph)
        del pm
        start_again(case.model)  # from the initial weights, as the corpus does (else it refuses to train)
        again = fairscale.parallelize(case.model, example_inputs=batch, loss_fn=case.loss_fn, plan=plan)
        assert again.train_step(batch) == loss
        return loss

    losses = fairscale.launch(rank, devices=2)
    assert losses[0] == losses[1]


class Present(nn.Module):
    """A head scored over the classes present in the batch: ``torch.unique`` sizes a tensor by values."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        present = torch.unique(y)
        return self.fc(x)[:, present].logsumexp(-1).mean()


def test_a_model_only_torch_fx_traces_is_refused_with_exports_reason() -> None:
    """A CTC model (F.ctc_loss, padded targets) was refused for every plan, the searched one too,
    with 'the stage split (passes/split_stages.py) failed on an internal error (a fairscale bug ...):
    KeyError: 'val'': torch.export could not trace aten._ctc_loss, the rank capture fell back to
    torch.fx, whose graph the passes cannot compile. The rank capture is torch.export's alone now,
    and the refusal is its reason: the op, the model's line and what to do. (CTC itself now
    captures, planner.ctc_capture; this model sizes a tensor by torch.unique of the labels.)"""
    batch = (torch.randn(8, 8), torch.randint(0, 6, (8,)))
    with pytest.raises(fairscale.PlanError) as info:
        fairscale.plan(Present(), batch, devices=2, constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})
    text = str(info.value)
    assert "internal error" not in text and "KeyError" not in text, text
    assert "could not capture Present: its forward needs a tensor's value" in text, text
    assert "torch.export: GuardOnDataDependentSymNode" in text, text
    assert "What to do:" in text, text
