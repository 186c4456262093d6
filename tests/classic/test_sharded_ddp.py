"""ShardedDataParallel (ZeRO-2) on gloo trains exactly like single-process Adam.

The ``set_to_none=True`` cases are the regression test for FairScale 0.4.13's bug: its gradient
buckets kept ``param.grad`` as views into long-lived buffers, so after ``zero_grad(set_to_none=True)``
fresh gradients were no longer in the buckets and stale values were reduced. Every step here uses
new data, and the owned gradients of each step are checked against the full-batch reference.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: once here, not in every forked rank)
from torch import nn

import fairscale
from fairscale.nn.data_parallel.sharded_ddp import ShardedDataParallel
from fairscale.optim import OSS
from fairscale.testing.models import build
from fairscale.testing.reference import Trajectory, compare
from passes.ops import comm
from planner.capture import LossModule

STEPS, BATCH, LR = 3, 8, 1e-2
VARIANTS = {
    "set_to_none": dict(set_to_none=True),
    "zero_fill": dict(set_to_none=False),
    "unbucketed": dict(set_to_none=True, reduce_buffer_size=0),
    "in_place_zero_fill": dict(set_to_none=False, reduce_buffer_size=0),
    "in_place_no_sync": dict(set_to_none=True, reduce_buffer_size=0, accumulate=True),
    "tiny_buckets": dict(set_to_none=True, reduce_buffer_size=4096),
    "no_sync": dict(set_to_none=True, accumulate=True),
    "freeze": dict(set_to_none=True, freeze=True),
    "sdp_zero_grad": dict(set_to_none=True, sdp_zero_grad=True),
    "two_optimizers": dict(set_to_none=True, two_optimizers=True),
    "freeze_no_refresh": dict(set_to_none=True, freeze=True, auto_refresh=False),
}


def _pack(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=False)


def _local(batch, rank: int, world: int):
    per = BATCH // world
    return tuple(t[rank * per:(rank + 1) * per] for t in batch)


def _reference(*, freeze: bool = False) -> tuple[Trajectory, list[dict[str, torch.Tensor]]]:
    case = build("mlp")
    wrapped = LossModule(case.model, case.loss_fn)
    opt = torch.optim.Adam(case.model.parameters(), lr=LR)
    out, grads = Trajectory(), []
    for step in range(STEPS):
        if freeze and step == 1:
            case.model.layers[0][0].weight.requires_grad_(False)
        opt.zero_grad(set_to_none=True)
        loss = wrapped(*case.make_batch(step, BATCH))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None})
        opt.step()
        out.losses.append(loss.item())
    out.params = {k: v.detach().clone() for k, v in case.model.state_dict().items()}
    return out, grads


def _train(rank: int, world: int, *, set_to_none: bool, reduce_buffer_size: int = 2**23,
           accumulate: bool = False, freeze: bool = False, sdp_zero_grad: bool = False,
           two_optimizers: bool = False, auto_refresh: bool = True) -> dict:
    case = build("mlp")
    params = list(case.model.parameters())
    opts = ([OSS(params[:4], optim=torch.optim.Adam, lr=LR), OSS(params[4:], optim=torch.optim.Adam, lr=LR)]
            if two_optimizers else [OSS(params, optim=torch.optim.Adam, lr=LR)])
    model = ShardedDataParallel(case.model, opts if two_optimizers else opts[0],
                                reduce_buffer_size=reduce_buffer_size, auto_refresh_trainable=auto_refresh)
    wrapped = LossModule(model, case.loss_fn)
    traj, grads, none_ok, warned = Trajectory(), [], True, []
    owned = {id(p) for opt in opts for p in opt.per_device_params[rank]}
    for step in range(STEPS):
        if freeze and step == 1:
            case.model.layers[0][0].weight.requires_grad_(False)
        for zeroer in ([model] if sdp_zero_grad else opts):
            zeroer.zero_grad(set_to_none=set_to_none)
        batch = _local(case.make_batch(step, BATCH), rank, world)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(batch[0][:1])  # a forward outside the loss: the trainable set is checked here
        warned.extend(str(w.message) for w in caught)
        # this rank's own gradient of its slice, from an untouched copy of the model
        local = build("mlp")
        local.model.load_state_dict(case.model.state_dict())
        LossModule(local.model, case.loss_fn)(*batch).backward()
        local_grads = {n: q.grad for n, q in local.model.named_parameters()}
        if accumulate:  # two half micro-batches, the first without communication
            half = len(batch[0]) // 2
            with model.no_sync():
                first = wrapped(*(t[:half] for t in batch)) / 2
                first.backward()
            second = wrapped(*(t[half:] for t in batch)) / 2
            second.backward()
            loss = (first + second).detach()
        else:
            loss = wrapped(*batch)
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in case.model.named_parameters()
                      if id(p) in owned and p.grad is not None})
        # FairScale 0.4.13's non-owner gradients: none where reduced in place, else this rank's
        # contribution to the average (its local gradient / world size)
        for n, p in case.model.named_parameters():
            if id(p) in owned or (p.grad is None and not p.requires_grad):
                continue
            if model._bucket_of[p].direct:
                none_ok &= p.grad is None
            else:
                none_ok &= p.grad is not None and torch.allclose(p.grad, local_grads[n] / world, atol=1e-6)
        for opt in opts:
            opt.step()
        g = loss.detach().clone()
        comm.all_reduce_(g, "zero")
        traj.losses.append(g.item() / world)
    traj.params = {k: v.detach().clone() for k, v in case.model.state_dict().items()}
    return {"traj": traj, "grads": grads, "none_ok": none_ok, "warned": warned}


class _Branchy(nn.Module):
    """Uses ``extra`` only when asked: a parameter that gets a gradient on some ranks and not others."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = self.a(x)
        if use_extra:
            h = h + self.extra(h)
        return self.b(h).sum()


def _rank_dependent_unused(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    net = _Branchy()
    manual = _Branchy()
    manual.load_state_dict(net.state_dict())
    opt = OSS(net.parameters(), lr=0.1)
    model = ShardedDataParallel(net, opt, reduce_buffer_size=0)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x, rank == 0).backward()
    manual(x, rank == 0).backward()
    err = 0.0
    for p, q in zip(net.parameters(), manual.parameters()):
        g = q.grad if q.grad is not None else torch.zeros_like(q)
        comm.all_reduce_(g, "zero")
        if opt.param_to_rank[p] == rank:
            err = max(err, (p.grad - g / world).abs().max().item())
    # now no rank uses `extra`: its owner must keep grad None, not a zero gradient
    opt.zero_grad(set_to_none=True)
    model(x, False).backward()
    unused_none = all(p.grad is None for p in net.extra.parameters())
    used_owned = all(p.grad is not None for p in net.a.parameters() if opt.param_to_rank[p] == rank)
    return {"err": err, "unused_none": unused_none, "used_owned": used_owned}


def _traffic(rank: int, world: int, *, reduce_fp16: bool) -> dict:
    """One step's collectives: every gradient is reduced once (to its owner), every updated
    parameter broadcast once (from its owner); and the fp16 reduction's gradient error."""
    case = build("mlp")
    opt = OSS(case.model.parameters(), optim=torch.optim.SGD, lr=0.1)
    model = ShardedDataParallel(case.model, opt, reduce_fp16=reduce_fp16)
    batch = _local(case.make_batch(0, BATCH), rank, world)
    comm.COUNTER.reset()
    LossModule(model, case.loss_fn)(*batch).backward()
    owned = {id(p) for p in opt.per_device_params[rank]}  # the reduced gradients
    grads = {n: p.grad.clone() for n, p in case.model.named_parameters() if id(p) in owned}
    opt.step()
    snap = comm.COUNTER.snapshot()
    return {"snap": snap, "grads": grads}


def _in_place(rank: int, world: int) -> dict:
    """reduce_buffer_size=0: each gradient is reduced alone, in the very tensor autograd produced
    (the launched buffer's address is the gradient's), with the had-a-gradient flags in one
    small all-reduce at the end of backward."""
    import fairscale.nn.data_parallel.sharded_ddp as sdp_module

    case = build("mlp")
    opt = OSS(case.model.parameters(), optim=torch.optim.SGD, lr=0.1)
    model = ShardedDataParallel(case.model, opt, reduce_buffer_size=0)
    produced: dict[str, int] = {}
    for name, p in case.model.named_parameters():  # runs after SDP's hook, which launched the reduce
        p.register_post_accumulate_grad_hook(lambda p, name=name: produced.__setitem__(name, p.grad.data_ptr()))
    launched: list[int] = []
    original = sdp_module.reduce_

    def watch(t: torch.Tensor, *a, **k):
        launched.append(t.data_ptr())
        return original(t, *a, **k)

    sdp_module.reduce_ = watch
    try:
        comm.COUNTER.reset()
        LossModule(model, case.loss_fn)(*_local(case.make_batch(0, BATCH), rank, world)).backward()
    finally:
        sdp_module.reduce_ = original
    names = [n for n, _ in case.model.named_parameters()]
    owned = {n: p.grad for n, p in case.model.named_parameters() if p.grad is not None}
    return {"snap": comm.COUNTER.snapshot(), "launched": launched, "produced": [produced[n] for n in reversed(names)],
            "owned_in_place": all(g.data_ptr() == produced[n] for n, g in owned.items()),
            "grads": {n: g.clone() for n, g in owned.items()}}


def _run(rank: int, world: int) -> bytes:
    out = {name: _train(rank, world, **kw) for name, kw in VARIANTS.items()}
    out["in_place"] = _in_place(rank, world)
    out["traffic"] = _traffic(rank, world, reduce_fp16=False)
    out["traffic16"] = _traffic(rank, world, reduce_fp16=True)
    out["branchy"] = _rank_dependent_unused(rank, world)
    try:
        ShardedDataParallel(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    except TypeError as e:
        out["type_error"] = str(e)
    lin, other = nn.Linear(2, 2), nn.Linear(2, 2)
    try:
        ShardedDataParallel(nn.Sequential(lin, other), OSS(lin.parameters(), lr=0.1))
    except ValueError as e:
        out["missing_error"] = str(e)
    return _pack(out)


@pytest.fixture(scope="module", params=[2, 4])
def runs(request):
    return request.param, [_unpack(r) for r in fairscale.launch(_run, devices=request.param)]


@pytest.fixture(scope="module")
def reference():
    return {False: _reference(), True: _reference(freeze=True)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sdp_trains_like_single_process(runs, reference, variant: str) -> None:
    _, results = runs
    ref, ref_grads = reference[VARIANTS[variant].get("freeze", False)]
    for r in results:
        got = r[variant]
        if variant == "freeze_no_refresh":  # warned once, and still exact: frozen grads are dropped
            assert len(got["warned"]) == 1 and "auto_refresh_trainable=False" in got["warned"][0]
        else:
            assert not got["warned"]
        compare(ref, got["traj"])
        assert got["none_ok"]
        for step, (mine, full) in enumerate(zip(got["grads"], ref_grads)):
            assert mine or variant.startswith("freeze"), f"step {step}: this rank owns no gradient"
            for name, g in mine.items():
                torch.testing.assert_close(g, full[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_every_gradient_reaches_its_owner(runs) -> None:
    _, results = runs
    n = len(list(build("mlp").model.parameters()))
    for step in range(STEPS):
        assert sum(len(r["set_to_none"]["grads"][step]) for r in results) == n


def test_parameter_unused_on_some_ranks(runs) -> None:
    _, results = runs
    for r in results:
        assert r["branchy"]["err"] < 1e-6
        assert r["branchy"]["unused_none"] and r["branchy"]["used_owned"]


def test_errors_name_the_fix(runs) -> None:
    _, results = runs
    assert "wrap your optimizer class: OSS(" in results[0]["type_error"]
    assert "not handled by any OSS optimizer" in results[0]["missing_error"]
    assert "1.weight" in results[0]["missing_error"]


def test_collectives_are_one_reduce_and_one_broadcast_per_parameter(runs) -> None:
    _, results = runs
    params = list(build("mlp").model.parameters())
    nbytes = sum(p.numel() * 4 for p in params)
    flags = 4 * len(params)  # one "had a gradient" flag per parameter rides with its bucket
    for r in results:
        snap = r["traffic"]["snap"]
        assert snap["reduce:zero"]["payload"] == nbytes + flags  # ZeRO-2: reduce, never all-reduce
        assert "all_reduce:zero" not in snap
        assert snap["broadcast:zero"]["payload"] == nbytes
        assert r["traffic16"]["snap"]["reduce:zero"]["payload"] == (nbytes + flags) // 2  # fp16 halves it


def test_large_gradients_are_reduced_in_place_in_backward_order(runs, reference) -> None:
    world, results = runs
    params = list(build("mlp").model.parameters())
    full = reference[False][1][0]
    for r in results:
        got = r["in_place"]
        # one reduce per gradient, launched on autograd's own tensor, last layer first
        assert got["launched"] == got["produced"]
        assert got["owned_in_place"] and got["grads"]
        snap = got["snap"]
        assert snap["reduce:zero"]["payload"] == sum(p.numel() * 4 for p in params)  # no flag rides along
        assert snap["reduce:zero"]["calls"] == len(params)
        assert snap["all_reduce:zero"] == {"bytes": pytest.approx(2 * (world - 1) / world * 4 * len(params)),
                                           "payload": 4 * len(params), "calls": 1}  # the flags, once
        for name, g in got["grads"].items():
            torch.testing.assert_close(g, full[name], rtol=1e-5, atol=1e-6)


def test_reduce_fp16_rounds_gradients_only_slightly(runs, reference) -> None:
    _, results = runs
    full = reference[False][1][0]  # the reference gradients of step 0
    for r in results:
        for name, g in r["traffic16"]["grads"].items():
            torch.testing.assert_close(g, full[name], rtol=1e-2, atol=1e-4)
            exact = r["traffic"]["grads"][name]
            assert g.dtype == exact.dtype == torch.float32


def _grad_of_grad(rank: int, world: int) -> dict:
    case = build("mlp")
    model = ShardedDataParallel(case.model, OSS(case.model.parameters(), optim=torch.optim.SGD, lr=0.1))
    out = {"multi_device": model.is_multi_device_module, "device_type": model.device_type}
    batch = _local(case.make_batch(0, BATCH), rank, world)
    try:  # a gradient graph (double backward) cannot be sharded: refused, not silently detached
        LossModule(model, case.loss_fn)(*batch).backward(create_graph=True)
    except RuntimeError as e:
        out["backward"] = str(e)
    model.zero_grad(set_to_none=True)
    first = next(case.model.parameters())
    first.grad = torch.zeros_like(first, requires_grad=True)
    try:
        model(batch[0])
    except RuntimeError as e:
        out["forward"] = str(e)
    return out


def test_grad_of_grad_is_refused_and_ddp_attributes() -> None:
    for r in fairscale.launch(_grad_of_grad, devices=2):
        assert r["multi_device"] is False and r["device_type"] == "cpu"
        assert "only works with gradients that don't require grad" in r["backward"]
        assert "only works with gradients that don't require grad" in r["forward"]
