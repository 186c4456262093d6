"""The ai2-tango FairScale integration's call sequence, on CPU gloo ranks, checked against an exact
single-process emulation of FSDP mixed precision.

What tango does (its FairScaleTrainingEngine): wrap regex-selected submodules with
``checkpoint_wrapper(offload_to_cpu=True)``, construct ``FullyShardedDataParallel(model,
reshard_after_forward=..., move_params_to_cpu=..., move_grads_to_cpu=..., mixed_precision=...)``,
train with ``clip_grad_norm_``, checkpoint each rank with ``local_state_dict()`` +
``local_metadata_dict()``, resume with ``load_local_state_dict()``, and export the final weights
with ``FullyShardedDataParallel.consolidate_shard_weights``.

The emulation: fp32 master weights; per rank, an fp16 copy runs forward/backward on the rank's
slice of the batch; gradients are summed over ranks in the reduce dtype (fp16 unless
``fp32_reduce_scatter``), divided by the world size, cast to fp32, clipped, and Adam steps.
"""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fairscale
from fairscale.nn.checkpoint import checkpoint_wrapper
from fairscale.nn.data_parallel import FullyShardedDataParallel
from fairscale.testing.models import build
from planner.capture import LossModule

STEPS, BATCH, LR, MAX_NORM = 3, 8, 1e-2, 0.5
CHECKPOINT_RE = r"layers\.[0-2]$"  # the regex a tango config would give: the MLP's hidden blocks


def _pack(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=False)


def _apply_checkpointing(model: nn.Module, pattern: str) -> list[str]:
    wrapped = []
    for name, module in list(model.named_modules()):
        if name and re.match(pattern, name):
            checkpoint_wrapper(module, offload_to_cpu=True)
            wrapped.append(name)
    return wrapped


def _tango_run(rank: int, world: int, fp32_reduce_scatter: bool) -> bytes:
    counts = {"fwd": 0}
    dtypes: list[torch.dtype] = []
    kwargs = dict(reshard_after_forward=True, move_params_to_cpu=True, move_grads_to_cpu=True, mixed_precision=True)
    if fp32_reduce_scatter:
        kwargs["fp32_reduce_scatter"] = True

    def make_model(seed: int) -> tuple[nn.Module, list[str]]:
        inner = build("mlp", seed=seed).model
        wrapped = _apply_checkpointing(inner, CHECKPOINT_RE)
        inner.layers[0][0].register_forward_hook(lambda m, i, o: counts.__setitem__("fwd", counts["fwd"] + 1))
        inner.layers[3].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
        return FullyShardedDataParallel(inner, **kwargs), wrapped

    case = build("mlp")
    model, wrapped = make_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loss_mod = LossModule(model, case.loss_fn)
    per = BATCH // world
    losses, norms, saved = [], [], None
    for step in range(STEPS):
        if step == STEPS - 1:  # tango's checkpoint + resume in the middle of training
            saved = {"weights": model.local_state_dict(), "metadata": model.local_metadata_dict(),
                     "optimizer": copy.deepcopy(opt.state_dict())}
            model, _ = make_model(7)  # other weights: the load must replace them
            model.load_local_state_dict(saved["weights"])
            opt = torch.optim.Adam(model.parameters(), lr=LR)
            opt.load_state_dict(saved["optimizer"])
            loss_mod = LossModule(model, case.loss_fn)
        x, y = case.make_batch(step, BATCH)
        opt.zero_grad(set_to_none=True)
        loss = loss_mod(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        norms.append(float(model.clip_grad_norm_(MAX_NORM)))
        opt.step()
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return _pack({"losses": losses, "norms": norms, "local": model.local_state_dict(),
                  "meta": model.local_metadata_dict(), "wrapped": wrapped, "fwd": counts["fwd"], "dtypes": dtypes,
                  "grad_device": [str(p.grad.device) for p in model.parameters()],
                  "master_dtype": [str(p.dtype) for p in model.parameters()]})


def _emulate(world: int, fp32_reduce_scatter: bool) -> dict:
    case = build("mlp")
    master = case.model
    opt = torch.optim.Adam(master.parameters(), lr=LR)
    per = BATCH // world
    losses, norms = [], []
    for step in range(STEPS):
        x, y = case.make_batch(step, BATCH)
        opt.zero_grad(set_to_none=True)
        total = None
        loss_sum = 0.0
        for r in range(world):
            half = copy.deepcopy(master).half()
            loss = case.loss_fn(half(x[r * per:(r + 1) * per].half()), y[r * per:(r + 1) * per])
            loss.backward()
            grads = [p.grad.float() if fp32_reduce_scatter else p.grad for p in half.parameters()]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
            loss_sum += loss.float().item()
        for p, g in zip(master.parameters(), total):
            p.grad = g.div(world).float()
        norms.append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), MAX_NORM)))
        opt.step()
        losses.append(loss_sum / world)
    return {"losses": losses, "norms": norms, "params": {k: v.clone() for k, v in master.state_dict().items()}}


@pytest.fixture(scope="module")
def runs():
    out = {}
    # fp16 reduction is order-exact only for 2 ranks (a + b commutes); 4 ranks reduce in fp32
    for world, fp32_rs in ((2, False), (4, True)):
        out[world] = ([_unpack(r) for r in fairscale.launch(_tango_run, devices=world, args=(fp32_rs,))],
                      _emulate(world, fp32_rs))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_tango_flow_matches_mixed_precision_emulation(runs, world):
    per_rank, ref = runs[world]
    for r in per_rank:
        for a, b in zip(ref["losses"], r["losses"]):
            assert abs(a - b) <= 1e-5 * abs(a), (ref["losses"], r["losses"])
        for a, b in zip(ref["norms"], r["norms"]):
            assert abs(a - b) <= 1e-4 * abs(a), (ref["norms"], r["norms"])
    full = FullyShardedDataParallel.consolidate_shard_weights(
        shard_weights=[r["local"] for r in per_rank], shard_metadata=[r["meta"] for r in per_rank])
    assert set(full) == set(ref["params"])
    for k, v in ref["params"].items():
        assert full[k].dtype == torch.float32
        assert (full[k] - v).abs().max().item() <= 1e-5, k


@pytest.mark.parametrize("world", [2, 4])
def test_tango_flow_mechanics(runs, world):
    per_rank, _ = runs[world]
    for r in per_rank:
        assert r["wrapped"] == ["layers.0", "layers.1", "layers.2"]
        assert r["fwd"] == 2 * STEPS  # checkpointed: every forward runs again in backward
        assert set(map(str, r["dtypes"])) == {"torch.float16"}  # compute in fp16
        assert set(r["master_dtype"]) == {"torch.float32"}  # fp32 master shards
        assert set(r["grad_device"]) == {"cpu"}
