"""Token-mean losses under data parallelism and microbatches (passes.loss_weights).

``cross_entropy(logits, labels)`` with ``-100`` labels (a masked-LM collator's, padding) is the
mean over the labels not ignored. Cut into dp slices and microbatches that count different
numbers of labels, the plain mean of the pieces' means is not the batch's mean: every such plan
trained silently to other numbers (Hugging Face BERT / RoBERTa / DistilBERT with masked-LM labels,
under dp4 and microbatches). The step now weighs each microbatch by its share of the labels.
The same for class-weighted cross entropy (by the labels' class weights) and for losses that sum
over the batch (every piece weighs dp), which had trained silently wrong too.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.testing.models import Case
from fairscale.testing.reference import RankResult, compare_grads, rank_trajectory, train_on_rank, train_reference
from passes.loss_weights import token_counter
from planner.capture import capture
from planner.plan import Mesh, Plan, Schedule, Stage

VOCAB, SEQ, BATCH, STEPS = 32, 8, 8, 3


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    keep = torch.rand((n, SEQ), generator=g) < torch.linspace(0.1, 0.9, n)[:, None]  # rows count differently
    return ids, torch.where(keep, ids, torch.full_like(ids, -100))


def _case() -> Case:
    torch.manual_seed(0)
    return Case("tiny-lm", TinyLM(), _batch, None)


def test_counter_counts_the_labels_the_loss_averages_over() -> None:
    batch = _batch(0, BATCH)
    counter = token_counter(capture(_case().model, batch, annotate=False).gm)
    assert counter is not None and counter.ignore_index == -100
    assert counter(batch) == int((batch[1] != -100).sum())
    halves = [counter((batch[0][i:i + 2], batch[1][i:i + 2])) for i in range(0, BATCH, 2)]
    assert len(set(halves)) > 1, halves  # the pieces of this batch count different numbers of labels


class _Scaled(nn.Module):
    """A summed (or averaged) token loss scaled by ``how``; ``count`` is a 0-dim batch input."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.head = how, nn.Linear(4, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(self.head(x), labels, reduction="mean" if "mean" in self.how else "sum")
        return {"sum / count": lambda: ce / count, "sum * count": lambda: ce * count,
                "count * sum": lambda: count * ce, "mean / count": lambda: ce / count,
                "count / sum": lambda: count / ce, "sum / rows": lambda: ce / x.size(0),
                "sum / labels kept": lambda: ce / (labels != -100).sum(), "sum / 2": lambda: ce / 2}[self.how]()


@pytest.mark.parametrize("how, kind, exact", [
    ("sum / count", "sum", True), ("sum * count", "sum", True), ("count * sum", "sum", True),
    ("mean / count", "mean", True),
    # not a loss scaled by a count every piece gets whole: a sum beside other terms, as before
    ("count / sum", "sum", False),
    # a sum over a number that is not a multiple of the rows: a sum, each piece's halved alike
    ("sum / 2", "sum", True),
    # a sum over the labels kept over their count: a token mean, the pieces weighed by their counts
    ("sum / labels kept", "mean", True),
    # divided by the rows (x.size(0), baked in as a number): a mean over rows, nothing to count
    ("sum / rows", None, None)])
def test_a_loss_scaled_by_a_0_dim_input_is_the_loss_it_scales(how: str, kind: str | None, exact: bool | None) -> None:
    """Hugging Face's ``sum / num_items_in_batch``: every piece gets the count whole, so the pieces'
    losses add up as the sum's own. A number is no such factor; a count of the piece's own labels
    makes the loss a token mean (``passes.loss_weights._count_divisor``)."""
    batch = (torch.randn(6, 4), torch.tensor([1, 2, -100, 3, 4, 5]), torch.tensor(5))
    counter = token_counter(capture(_Scaled(how), batch, annotate=False).gm)
    got = (counter.kind, counter.exact) if counter is not None else (None, None)
    assert got == (kind, exact), counter


def test_hugging_face_shifted_labels_are_counted_after_the_shift() -> None:
    from fairscale.testing.corpus_hf import MODELS

    case = MODELS["hf-llama"].build(0)
    ids, labels = case.make_batch(0, 2)
    labels[0, :5] = -100
    counter = token_counter(capture(case.model, (ids, labels), annotate=False).gm)
    assert counter is not None  # ForCausalLMLoss: pad with -100, drop the first label, flatten
    assert counter((ids, labels)) == 2 * (labels.shape[1] - 1) - 4


def test_other_losses_keep_the_plain_mean() -> None:
    model = nn.Linear(4, 3)
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    for loss_fn in (lambda out, t: F.mse_loss(out, F.one_hot(t, 3).float()),
                    lambda out, t: F.cross_entropy(out, t, reduction="none").mean()):
        assert token_counter(capture(model, (x, y), loss_fn=loss_fn, annotate=False).gm) is None


# --- losses that are not a plain mean over rows: class weights, sums ----------------------------

CLASS_WEIGHT = torch.tensor([1.0, 5.0, 0.2, 3.0])
ROW_LOSSES = {  # name: (loss_fn, counter kind; None: the plain mean)
    "class-weighted": (lambda out, y: F.cross_entropy(out, y, weight=CLASS_WEIGHT), "mean"),
    "class-weighted-ignore": (lambda out, y: F.cross_entropy(out, y, weight=CLASS_WEIGHT, ignore_index=3), "mean"),
    "sum": (lambda out, y: F.cross_entropy(out, y, reduction="sum"), "sum"),
    "none-then-sum": (lambda out, y: F.cross_entropy(out, y, reduction="none").sum(), "sum"),
    "mse-sum": (lambda out, y: F.mse_loss(out, F.one_hot(y, 4).float(), reduction="sum"), "sum"),
}


def _mlp_case(loss: str) -> Case:
    def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        labels = torch.tensor([0, 0, 0, 0, 0, 1, 2, 3] * (n // 8))  # classes of different weights per piece
        return torch.randn(n, 16, generator=g), labels[torch.randperm(n, generator=g)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return Case(loss, model, batch, ROW_LOSSES[loss][0])


def test_class_weights_and_sums_are_recognized() -> None:
    for name, (_, kind) in ROW_LOSSES.items():
        case = _mlp_case(name)
        batch = case.make_batch(0, BATCH)
        counter = token_counter(capture(case.model, batch, loss_fn=case.loss_fn, annotate=False).gm)
        assert counter is not None and counter.kind == kind and counter.exact, name
        if name.startswith("class-weighted"):  # the sum of the kept labels' weights
            kept = batch[1] != (3 if name.endswith("ignore") else -100)
            assert counter(batch) == pytest.approx(float(CLASS_WEIGHT[batch[1][kept]].sum())), name


ROW_PLANS = {"dp4": Plan(mesh=Mesh(dp=4), schedule=Schedule(kind="1f1b", microbatches=1)),
             "dp4x2mb": Plan(mesh=Mesh(dp=4), schedule=Schedule(kind="1f1b", microbatches=2)),
             "pp2xdp2": Plan(mesh=Mesh(pp=2, dp=2), schedule=Schedule(kind="1f1b", microbatches=2),
                             stages=[Stage(layers="0, 1"), Stage(layers="2")])}


def _row_rank(rank: int, world: int) -> dict[tuple[str, str], RankResult]:
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    return {(loss, name): train_on_rank(_mlp_case(loss), plan, steps=STEPS, global_batch=BATCH, optimizer=sgd)
            for loss in ROW_LOSSES for name, plan in ROW_PLANS.items()}


def test_class_weighted_and_summed_losses_match_one_process() -> None:
    """``CrossEntropyLoss(weight=...)`` is the mean weighted by the labels' class weights, and a
    ``reduction="sum"`` loss the sum over the batch: the plain mean of the pieces' losses had made
    the first wrong by a few percent and the second ``1 / (dp · microbatches)`` of itself, silently
    (found by a review on code the project did not write)."""
    got = fairscale.launch(_row_rank, devices=4)[0]
    for loss in ROW_LOSSES:
        ref = train_reference(lambda: _mlp_case(loss), steps=STEPS, global_batch=BATCH,
                              optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
        for name in ROW_PLANS:
            compare_grads(ref, rank_trajectory(got[(loss, name)]))


def _sum_aux_rank(rank: int, world: int) -> list[float]:
    case = _mlp_case("sum")
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH),
                               loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="sum") + out.pow(2).mean(),
                               plan=ROW_PLANS["dp4"], optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    return [pm.train_step(case.make_batch(0, BATCH))]


def test_a_sum_beside_a_mean_is_refused_before_launch() -> None:
    from planner.search import NoCompilablePlan

    case = _mlp_case("sum")
    with pytest.raises(NoCompilablePlan, match="the loss check .* adds a sum over the batch .* Return the sum"):
        fairscale.search(case.model, case.make_batch(0, BATCH), devices=4,
                         loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="sum") + out.pow(2).mean(),
                         constraints={"mesh": {"pp": 1, "dp": 4, "tp": 1}})
    with pytest.raises(Exception) as info:  # and parallelize refuses it on every rank, before building
        fairscale.launch(_sum_aux_rank, devices=4)
    assert "adds a sum over the batch" in str(info.value) and "the plan does not compile" in str(info.value)


def _rank(rank: int, world: int, plan: Plan) -> RankResult:
    return train_on_rank(_case(), plan, steps=STEPS, global_batch=BATCH, optimizer=functools.partial(torch.optim.SGD, lr=0.5))


@pytest.mark.parametrize("mesh,micro", [((1, 2), 2), ((2, 2), 2), ((1, 4), 1)], ids=["dp2x2mb", "pp2xdp2x2mb", "dp4"])
def test_token_mean_matches_one_process(mesh: tuple[int, int], micro: int) -> None:
    pp, dp = mesh
    stages = [Stage(layers="embed, layers.0"), Stage(layers="layers.1, head")] if pp == 2 else []
    plan = Plan(mesh=Mesh(pp=pp, dp=dp), schedule=Schedule(kind="1f1b", microbatches=micro), stages=stages)
    ref = train_reference(_case, steps=STEPS, global_batch=BATCH,
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
    compare_grads(ref, rank_trajectory(fairscale.launch(_rank, devices=pp * dp, args=(plan,))[0]))


def _plain_rank(rank: int, world: int, plan: Plan) -> dict[str, np.ndarray]:
    case = _case()
    pm = fairscale.parallelize(case.model, example_inputs=_batch(0, BATCH), plan=plan,
                               optimizer=functools.partial(torch.optim.SGD, lr=0.5))
    pm(*_batch(0, BATCH)).backward()
    return {k: v.numpy() for k, v in pm.full_grads().items()}


def test_the_plain_loop_weighs_each_rank_by_its_labels() -> None:
    """``loss = pm(*batch); loss.backward()`` under dp4: each rank's mean counts other labels; the
    gradient is the batch's token mean, as in one process (before: the mean of the ranks' means)."""
    plan = Plan(mesh=Mesh(dp=4), schedule=Schedule(kind="1f1b", microbatches=1))
    case = _case()
    batch = _batch(0, BATCH)
    case.model(*batch).backward()
    want = {k: p.grad for k, p in case.model.named_parameters()}
    got = fairscale.launch(_plain_rank, devices=4, args=(plan,))[0]
    for k, g in want.items():
        err = float((torch.from_numpy(got[k]) - g).norm() / g.norm())
        assert err < 1e-5, f"{k}: relative error {err:.2e}"


class TinyLMWithAux(TinyLM):
    """A token mean plus an auxiliary term (as MoE models add a load-balancing loss)."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        ce = F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
        return ce + 0.01 * x.pow(2).mean()


def test_a_token_mean_inside_a_larger_loss_is_found_but_not_reweighted() -> None:
    torch.manual_seed(0)
    batch = _batch(0, BATCH)
    counter = token_counter(capture(TinyLMWithAux(), batch, annotate=False).gm)
    assert counter is not None and not counter.exact
    assert counter(batch) == int((batch[1] != -100).sum())


def _aux_rank(rank: int, world: int, plan: Plan, uneven: bool) -> list[float]:
    torch.manual_seed(0)
    model = TinyLMWithAux()
    make = _batch if uneven else (lambda step, n: (_batch(step, n)[0], _batch(step, n)[0]))
    pm = fairscale.parallelize(model, example_inputs=make(0, BATCH), plan=plan,
                               optimizer=functools.partial(torch.optim.SGD, lr=0.5))
    return [pm.train_step(make(step, BATCH)) for step in range(2)]


def test_a_mixed_loss_whose_pieces_count_differently_is_refused_on_every_rank() -> None:
    plan = Plan(mesh=Mesh(dp=2), schedule=Schedule(kind="1f1b", microbatches=1))
    with pytest.raises(Exception) as info:
        fairscale.launch(_aux_rank, devices=2, args=(plan, True))
    text = str(info.value)
    assert "combined with other terms" in text and "count different numbers of labels" in text, text
    losses = fairscale.launch(_aux_rank, devices=2, args=(plan, False))[0]  # no ignored labels: exact
    torch.manual_seed(0)
    model = TinyLMWithAux()
    ids = _batch(0, BATCH)[0]
    assert abs(losses[0] - float(model(ids, ids))) < 1e-5


def _runner_rank(rank: int, world: int, local: bool) -> tuple[float, dict[str, np.ndarray]]:
    from fairscale.data_parallel import DataParallelRunner

    graph = capture(_case().model, _batch(0, BATCH))
    runner = DataParallelRunner.build(graph, Plan(mesh=Mesh(dp=world)), torch.optim.SGD, lr=0.5)
    batch = _batch(0, BATCH)
    if local:  # each rank passes only its own rows
        rows = BATCH // world
        batch = tuple(x[rank * rows:(rank + 1) * rows] for x in batch)
    loss = runner.train_step(batch, microbatches=2, local=local)
    return loss, {k: v.numpy() for k, v in runner.full_state_dict().items()}


@pytest.mark.parametrize("local", [False, True], ids=["global-batch", "local-slices"])
def test_the_data_parallel_runner_weighs_pieces_by_their_labels(local: bool) -> None:
    ref = train_reference(_case, steps=1, global_batch=BATCH, optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
    loss, params = fairscale.launch(_runner_rank, devices=2, args=(local,))[0]
    assert abs(loss - ref.losses[0]) < 1e-5 * abs(ref.losses[0]), (loss, ref.losses[0])
    for k, v in ref.params.items():
        assert torch.allclose(torch.from_numpy(params[k]), v, atol=1e-5), k


def test_class_weights_the_model_computes_are_refused_before_launch() -> None:
    from planner.search import NoCompilablePlan

    case = _mlp_case("class-weighted")
    with pytest.raises(NoCompilablePlan, match="class-weighted mean .* cannot be counted before the step"):
        fairscale.search(case.model, case.make_batch(0, BATCH), devices=4,
                         loss_fn=lambda out, y: F.cross_entropy(out, y, weight=out.detach().abs().mean(0)),
                         constraints={"mesh": {"pp": 1, "dp": 4, "tp": 1}})
