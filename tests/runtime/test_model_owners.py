"""A model parallelized again, or sharing trainable weights with another ParallelModule's model
(``fairscale.runtime.model_owners``).

Each ParallelModule trains copies of its model's weights; the model keeps the values it had. A
script that parallelized its model again after training (another plan mid-script, after
``pm.close()``, or once the first module was collected) trained the new module from the initial
weights, the steps taken lost; a GAN whose discriminator and generator losses are each a module
holding both nets trained the generator against a discriminator that never moved (0.605 against
0.617 at step 0 on 2 ranks), both silently. The second is refused at ``parallelize``; the first at
the new module's first call, unless ``pm.load_checkpoint`` replaces the weights first.
"""

from __future__ import annotations

import functools
import re
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.runtime.model_guard import StaleModelError
from fairscale.runtime.model_owners import SharedWeightsError
from planner.plan import Mesh, Plan, Schedule

BATCH, STEPS = 8, 4
DP2 = Plan(mesh=Mesh(dp=2), schedule=Schedule(kind="1f1b", microbatches=1, global_batch=BATCH))
SGD = functools.partial(torch.optim.SGD, lr=0.1)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def _one_process() -> list[float]:
    model = _net()
    opt = SGD(model.parameters())
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(_batch(step)[0]), _batch(step)[1])
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


class _Pair(nn.Module):
    """A GAN's loss over both nets (the discriminator's, or the generator's through it)."""

    def __init__(self, g: nn.Module, d: nn.Module) -> None:
        super().__init__()
        self.g, self.d = g, d

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.d(self.g(z)).square().mean()


def _parallelize(model: nn.Module) -> fairscale.ParallelModule:
    return fairscale.parallelize(model, example_inputs=_batch(0), loss_fn=F.cross_entropy, plan=DP2, optimizer=SGD)


def _again(how: str, path: str) -> list[float] | str:
    model = _net()
    pm = _parallelize(model)
    losses = [pm.train_step(_batch(step)) for step in range(2)]
    if how == "gather":
        pm.gather_into(model)
    elif how == "checkpoint":
        pm.save_checkpoint(path)
    elif how == "close":
        pm.close()
    second = _parallelize(model)
    if how == "checkpoint":
        second.load_checkpoint(path)
    try:
        return losses + [second.train_step(_batch(step)) for step in range(2, STEPS)]
    except StaleModelError as exc:
        return str(exc)


def refused_text(fn) -> str:
    try:
        fn()
    except StaleModelError as exc:
        return str(exc)
    return "(not refused)"


def _rank(rank: int, world: int, path: str) -> dict[str, object]:
    out: dict[str, object] = {how: _again(how, os.path.join(path, how)) for how in
                              ("gather", "checkpoint", "live", "close")}
    model = _net()
    pm = _parallelize(model)
    pretrained = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).state_dict()
    model.load_state_dict(pretrained)  # after parallelize: pm would train the weights it copied
    out["loaded after"] = refused_text(lambda: pm.train_step(_batch(0)))
    model = _net()
    pm = _parallelize(model)
    pm.train_step(_batch(0))
    full = pm.state_dict()
    if rank == 0:
        model.load_state_dict(full)  # the ranks' weights, the model behind: current again
    out["loaded behind"] = refused_text(lambda: pm.train_step(_batch(1)))
    g, d = nn.Linear(4, 8), nn.Linear(8, 1)
    pairs = [_Pair(g, d), _Pair(g, d)]  # the script holds its models
    first = fairscale.parallelize(pairs[0], example_inputs=(torch.randn(BATCH, 4),), plan=DP2, optimizer=SGD)
    with pytest.raises(SharedWeightsError) as refused:
        fairscale.parallelize(pairs[1], example_inputs=(torch.randn(BATCH, 4),), plan=DP2, optimizer=SGD)
    out["shared"] = str(refused.value)
    first.close()  # closed: its weights may be given to another module
    g.requires_grad_(False)
    pairs += [_Pair(g, d), _Pair(g, nn.Linear(8, 1))]  # g frozen in both, each its own d
    second = fairscale.parallelize(pairs[2], example_inputs=(torch.randn(BATCH, 4),), plan=DP2, optimizer=SGD)
    third = fairscale.parallelize(pairs[3], example_inputs=(torch.randn(BATCH, 4),), plan=DP2, optimizer=SGD)
    out["frozen shared"] = (second.train_step((torch.randn(BATCH, 4),)), third.train_step((torch.randn(BATCH, 4),)))
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    with tempfile.TemporaryDirectory() as path:
        return fairscale.launch(_rank, devices=2, args=(path,))


@pytest.mark.parametrize("how", ["gather", "checkpoint"])
def test_a_model_parallelized_again_goes_on_from_the_trained_weights(runs, how) -> None:
    want = _one_process()
    for out in runs:
        got = out[how]
        assert isinstance(got, list), got
        assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("how", ["live", "close"])
def test_a_module_built_from_a_model_behind_refuses_to_train(runs, how) -> None:
    for out in runs:
        assert isinstance(out[how], str)
        assert out[how].startswith("pm.train_step: this ParallelModule was built by fairscale.parallelize from "
                                   "weights that are not the trained ones (the model (Sequential) was behind since "
                                   "an optimizer step of its ParallelModule)")
        assert "pm.gather_into(model)" in out[how] and "pm.load_checkpoint(dir)" in out[how]


def test_weights_loaded_into_the_model_after_parallelize_are_refused(runs) -> None:
    """They had been ignored: the module trained the weights it had copied (pretrained weights loaded
    after the call, silently never used)."""
    for out in runs:
        assert out["loaded after"].startswith("pm.train_step: model.load_state_dict(...) loaded weights into the "
                                              "Sequential after fairscale.parallelize built this ParallelModule"), out
        assert out["loaded behind"] == "(not refused)"  # pm.state_dict() loaded on rank 0 while behind


def test_trainable_weights_shared_with_an_open_module_are_refused(runs) -> None:
    for out in runs:
        assert out["shared"].startswith("fairscale.parallelize: the _Pair given shares trainable parameters (g.weight, "
                                        "g.bias, d.weight, d.bias) with the _Pair of a ParallelModule that is still "
                                        "open")
        assert "pm.close()" in out["shared"]
        assert all(isinstance(x, float) for x in out["frozen shared"])


def test_a_parallel_module_is_neither_copied_nor_pickled() -> None:
    """``copy.deepcopy(pm)`` had made a module whose first call failed inside its optimizer
    ('StageOptimizers' object has no attribute '_groups'); ``torch.save(pm)`` failed on a weak reference."""
    import copy
    import io

    from fairscale.runtime.engine import ParallelModule

    pm = ParallelModule.__new__(ParallelModule)  # the refusal reads nothing of the module
    for what, call in (("copy.deepcopy", copy.deepcopy), ("copy.copy", copy.copy),
                       ("pickling (torch.save)", lambda m: torch.save(m, io.BytesIO()))):
        with pytest.raises(TypeError, match=rf"^{re.escape(what)} of a ParallelModule: .* pm.save_checkpoint\(dir\)"):
            call(pm)
