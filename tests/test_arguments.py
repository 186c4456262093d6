"""What users hand the public API is checked at the call, with the argument named and the accepted
forms said (not an IndexError from the annotator)."""

from __future__ import annotations

import functools

import pytest
import torch

import fairscale
from fairscale.testing.models import build


@pytest.fixture(scope="module")
def case():
    return build("gpt", layers=2, dim=32, heads=2, seq=8, vocab=64)


def test_a_bare_tensor_or_a_dict_batch(case) -> None:
    x, y = case.make_batch(0, 4)
    with pytest.raises(TypeError, match=r"example_inputs must be a tuple of the model's positional inputs, got a "
                                        r"Tensor of shape \(4, 8\); wrap a single input as \(x,\)"):
        fairscale.search(case.model, x, devices=2, loss_fn=case.loss_fn)
    with pytest.raises(TypeError, match=r"example_inputs is a dict \(x, y\) and loss_fn is given: with loss_fn the batch is"):
        fairscale.search(case.model, {"x": x, "y": y}, devices=2, loss_fn=case.loss_fn)
    with pytest.raises(TypeError, match="example_inputs must be a non-empty tuple"):
        fairscale.search(case.model, (), devices=2)
    with pytest.raises(ValueError, match="example_inputs holds no tensor with a batch dimension"):
        fairscale.search(case.model, (3, torch.tensor(1.0)), devices=2)


def test_a_model_without_parameters_or_not_a_module() -> None:
    with pytest.raises(ValueError, match=r"model \(ReLU\) has no parameters, so there is nothing to train"):
        fairscale.search(torch.nn.ReLU(), (torch.randn(2, 3),), devices=2)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        fairscale.search(lambda x: x, (torch.randn(2, 3),), devices=2)


def test_a_model_on_meta_is_planned_but_not_parallelized() -> None:
    """It had crashed inside the stage split (KeyError: 'val') after planning on rank 0."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    batch = (torch.randn(8, 8), torch.arange(8) % 4)
    loss_fn = torch.nn.functional.cross_entropy
    assert fairscale.plan(model, batch, devices=2, loss_fn=loss_fn).mesh.size == 2
    with pytest.raises(ValueError, match=r"model \(Sequential\) has 4 parameters or buffers on the meta device "
                                         r"\(0.weight, 0.bias, 2.weight, ...\).*materialize_meta\(model, seed=...\)"):
        fairscale.parallelize(model, example_inputs=batch, loss_fn=loss_fn, devices=2)


def test_an_optimizer_instance_is_read_into_its_groups_or_refused_with_why(case) -> None:
    from fairscale.arguments import check_optimizer

    model = case.model
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95))
    spec = check_optimizer(opt, model)
    assert spec.cls is torch.optim.AdamW and [o["weight_decay"] for o in spec.options] == [0.1, 0.0]
    assert spec.options[0]["betas"] == (0.9, 0.95) and spec.defaults["lr"] == 3e-4
    names = dict(model.named_parameters(remove_duplicate=False))  # tied names too
    assert {n for n, g in spec.group_of.items() if g == 0} == {n for n, p in names.items() if p.dim() >= 2}
    assert set(spec.group_of) == set(names)

    with pytest.raises(ValueError, match=r"the trainable parameter\(s\) .* are in none of its 1 group\(s\); torch "
                                         r"would compute their gradients and never update them"):
        check_optimizer(torch.optim.SGD(decay, lr=0.1), model)
    stranger = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"optimizer.param_groups\[0\] holds a tensor of shape \(2, 2\) that is not "
                                         r"a parameter of the model"):
        check_optimizer(torch.optim.SGD(stranger.parameters(), lr=0.1), model)
    stepped = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    loss = case.loss_fn(model(case.make_batch(0, 4)[0]), case.make_batch(0, 4)[1])
    loss.backward()
    stepped.step()
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=r"this SGD has state .* resume with pm.save_checkpoint"):
        check_optimizer(stepped, model)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer subclass, a functools.partial"):
        fairscale.parallelize(case.model, 2, example_inputs=case.make_batch(0, 4), loss_fn=case.loss_fn,
                              optimizer="adam")
    # the accepted forms pass the check (and then need launched ranks)
    for accepted in (functools.partial(torch.optim.AdamW, lr=3e-4), opt):
        with pytest.raises(RuntimeError, match="parallelize runs on every rank"):
            fairscale.parallelize(case.model, 2, example_inputs=case.make_batch(0, 4), loss_fn=case.loss_fn,
                                  optimizer=accepted)


def test_devices_and_loss_fn(case) -> None:
    with pytest.raises(ValueError, match="devices must be a positive int"):
        fairscale.search(case.model, case.make_batch(0, 4), devices=0, loss_fn=case.loss_fn)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        fairscale.search(case.model, case.make_batch(0, 4), devices=2, loss_fn="cross_entropy")


def test_a_plan_given_as_a_dict_or_with_constraints(case) -> None:
    """``plan={"mesh": {"dp": 2}}`` raised AttributeError ('dict' object has no attribute
    'data_parallel') on every rank; it is refused at the call (no ranks needed), pointing to
    ``constraints`` (fields to keep, the search choosing the rest) or ``Plan.from_dict``."""
    batch = case.make_batch(0, 4)
    with pytest.raises(TypeError, match=r"plan must be a fairscale.Plan or the path of a plan file, got a dict.*"
                                        r"constraints=\{'mesh': \{'dp': 2\}\}.*Plan.from_dict"):
        fairscale.parallelize(case.model, example_inputs=batch, loss_fn=case.loss_fn, plan={"mesh": {"dp": 2}})
    with pytest.raises(TypeError, match="got int 3"):
        fairscale.parallelize(case.model, example_inputs=batch, loss_fn=case.loss_fn, plan=3)
    plan = fairscale.plan(case.model, batch, devices=1, loss_fn=case.loss_fn)
    with pytest.raises(ValueError, match="pass plan or constraints, not both"):
        fairscale.parallelize(case.model, example_inputs=batch, loss_fn=case.loss_fn, plan=plan,
                              constraints={"mesh": {"dp": 1}})


class _Bags(torch.nn.Module):
    """DLRM's layout: offsets and indices per table, [tables, batch] and [tables, indices]."""

    def __init__(self) -> None:
        super().__init__()
        self.bags, self.dense = torch.nn.EmbeddingBag(20, 4), torch.nn.Linear(4, 4)

    def forward(self, dense: torch.Tensor, offsets: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        pooled = sum(self.bags(indices[k], offsets[k]) for k in range(offsets.shape[0]))
        return (self.dense(dense) * pooled).sum(1).pow(2).mean()


def test_inputs_whose_dim_0_is_not_the_batchs_rows_are_refused_naming_them() -> None:
    """DLRM with its [tables, batch] offsets planned tp4 (the batch whole), and crashed at its first
    step on every rank: the ranks' capture had tiled the offsets to the batch's 8 rows ([8, 8]), and
    the real [3, 8] then failed the step's shape check. A PyG-style graph batch (x [nodes, F],
    edge_index [2, edges]) was refused by the loss check's IndexError, or by 'microbatches=2 does not
    divide the per-replica batch 9' (its 36 nodes read as the batch)."""
    torch.manual_seed(0)
    batch = (torch.randn(8, 4), torch.arange(0, 24, 3).repeat(3, 1), torch.randint(0, 20, (3, 24)))
    for call in (lambda: fairscale.plan(_Bags(), batch, devices=4),
                 lambda: fairscale.parallelize(_Bags(), example_inputs=batch, devices=4)):
        with pytest.raises(fairscale.PlanError, match=r"input 1 \(shape \[3, 8\]\) has 3 rows along dim 0, but "
                                                      r"input 0 \(shape \[8, 4\]\) has 8") as err:
            call()
        assert "pass every input batch first" in str(err.value)
    from fairscale.arguments import check_example_inputs

    assert len(check_example_inputs((batch[0], torch.tensor(2.0), batch[0]))) == 3  # a 0-dim tensor has no rows
