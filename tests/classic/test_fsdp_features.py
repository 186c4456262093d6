"""FSDP methods and options beyond plain training: summon_full_params, optimizer-state round trip,
clipping, state-dict options, mixed-precision buffers, reset_parameters, and the errors/warnings
for what our runtime does not do. Multi-rank checks share one 2-rank launch."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fairscale
from fairscale.nn import FullyShardedDataParallel as FSDP
from fairscale.nn import checkpoint_wrapper
from fairscale.nn.data_parallel import TrainingState
from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_mod
from fairscale.testing.models import build
from planner.capture import LossModule

BATCH, LR = 8, 1e-2


def _pack(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=False)


def _nested_mlp(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(unwrapped reference copy, FSDP root with one nested instance)."""
    case = build("mlp", seed=seed)
    ref = copy.deepcopy(case.model)
    case.model.layers[1] = FSDP(case.model.layers[1])
    return ref, FSDP(case.model)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world: int) -> None:
    case = build("mlp")
    loss_mod = LossModule(model, case.loss_fn)
    per = BATCH // world
    for step in steps:
        x, y = case.make_batch(step, BATCH)
        opt.zero_grad(set_to_none=True)
        loss_mod(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        opt.step()


class TwiceNet(nn.Module):
    """Calls one submodule twice per forward: two all-gathers and two reduce-scatters per step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.shared, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.shared(torch.relu(self.shared(self.a(x)))))


def _twice_step(model: nn.Module, rank: int, world: int) -> dict:
    x = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(1))
    per = BATCH // world
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(x[rank * per:(rank + 1) * per]).pow(2).mean().backward()
    opt.step()
    return model.state_dict()


def _rank_checks(rank: int, world: int) -> bytes:
    out: dict = {}
    for reshard in (True, False):
        for ckpt in (False, True):
            net = TwiceNet()
            inner = FSDP(net.shared, reshard_after_forward=reshard)
            net.shared = checkpoint_wrapper(inner) if ckpt else inner
            out[("twice", reshard, ckpt)] = _twice_step(FSDP(net, reshard_after_forward=reshard), rank, world)
    ref, model = _nested_mlp()
    # summon: clean names, full values, write-back unless volatile
    with model.summon_full_params():
        out["summon_names"] = [n for n, _ in model.named_parameters()]
        out["summon_equal"] = all(torch.equal(p, dict(ref.named_parameters())[n]) for n, p in model.named_parameters())
        out["state_in_summon"] = model.training_state == TrainingState.SUMMON_FULL_PARAMS
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    with model.summon_full_params(volatile=True):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.0)
    sd = model.state_dict()
    out["write_back"] = all(torch.allclose(sd[k], v + 1.0) for k, v in ref.state_dict().items())
    with model.summon_full_params(recurse=False):
        out["non_recursive_names"] = [n for n, _ in model.named_parameters()]

    # optimizer state: gather on rank 0, broadcast, shard into a fresh optimizer, continue training
    _, model = _nested_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    _train(model, opt, range(3), rank, world)
    full = [model.gather_full_optim_state_dict(opt)]
    dist.broadcast_object_list(full, src=0)
    weights = model.state_dict()
    _, resumed = _nested_mlp(seed=5)
    resumed.load_state_dict(weights)
    opt2 = torch.optim.Adam(resumed.parameters(), lr=LR)
    opt2.load_state_dict(resumed.get_shard_from_optim_state_dict(full[0]))
    _train(resumed, opt2, range(3, 4), rank, world)
    out["resumed_state"] = resumed.state_dict()

    # gradient_predivide_factor: the same (scale-sensitive) gradients as without it
    case = build("mlp")
    x, y = case.make_batch(0, BATCH)
    per = BATCH // world
    grads = {}
    for pre in (None, 4.0):
        model = FSDP(build("mlp").model, gradient_predivide_factor=pre)
        LossModule(model, case.loss_fn)(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        grads[pre] = [p.grad.clone() for p in model.parameters()]
    out["predivide_equal"] = all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(grads[None], grads[4.0]))
    out["predivide_nonzero"] = all(bool(g.abs().sum() > 0) for g in grads[4.0])

    # clipping, inf norm
    _, model = _nested_mlp()
    case = build("mlp")
    x, y = case.make_batch(0, BATCH)
    per = BATCH // world
    LossModule(model, case.loss_fn)(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
    out["inf_norm"] = float(model.clip_grad_norm_(1e-3, norm_type=float("inf")))
    out["clipped_inf"] = max(float(p.grad.abs().max()) for p in model.parameters())

    # rank-0-only state dict
    model = FSDP(build("mlp").model, state_dict_on_rank_0_only=True, state_dict_device="cpu")
    out["rank0_only_len"] = len(model.state_dict())

    # reset_parameters agrees across ranks
    torch.manual_seed(100 + rank)  # different RNG per rank: the broadcast must make them agree
    model = FSDP(nn.Linear(6, 5), allow_reset_parameters=True)
    with model.summon_full_params():
        model.reset_parameters()
    out["reset_state"] = model.state_dict()
    return _pack(out)


@pytest.fixture(scope="module")
def ranks():
    return [_unpack(r) for r in fairscale.launch(_rank_checks, devices=2)]


def _reference_steps(steps: int) -> dict[str, torch.Tensor]:
    case = build("mlp")
    loss_mod = LossModule(case.model, case.loss_fn)
    opt = torch.optim.Adam(case.model.parameters(), lr=LR)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss_mod(*case.make_batch(step, BATCH)).backward()
        opt.step()
    return case.model.state_dict()


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("ckpt", [False, True])
def test_module_called_twice_per_forward(ranks, reshard, ckpt):
    ref = _twice_step(TwiceNet(), 0, 1)
    for r in ranks:
        got = r[("twice", reshard, ckpt)]
        assert set(got) == set(ref)
        for k, v in ref.items():
            assert (got[k] - v).abs().max() <= 1e-6, k


def test_summon_full_params(ranks):
    ref = build("mlp").model
    names = [n for n, _ in ref.named_parameters()]
    for r in ranks:
        assert sorted(r["summon_names"]) == sorted(names)
        assert r["summon_equal"] and r["state_in_summon"] and r["write_back"]
        # recurse=False: the nested instance stays sharded under its wrapper name
        assert any("flat_param" in n for n in r["non_recursive_names"])
        assert "layers.0.0.weight" in r["non_recursive_names"]


def test_optim_state_round_trip_continues_exactly(ranks):
    ref = _reference_steps(4)
    for r in ranks:
        for k, v in ref.items():
            assert (r["resumed_state"][k] - v).abs().max() <= 1e-5, k


def test_gradient_predivide_factor_keeps_the_mean(ranks):
    assert all(r["predivide_equal"] and r["predivide_nonzero"] for r in ranks)


def test_clip_inf_norm(ranks):
    case = build("mlp")
    LossModule(case.model, case.loss_fn)(*case.make_batch(0, BATCH)).backward()
    expected = float(torch.nn.utils.clip_grad_norm_(case.model.parameters(), 1e-3, norm_type=float("inf")))
    for r in ranks:
        assert abs(r["inf_norm"] - expected) <= 1e-6 * expected
        assert r["clipped_inf"] <= 1e-3 * (1 + 1e-5)


def test_state_dict_on_rank_0_only(ranks):
    assert ranks[0]["rank0_only_len"] == len(build("mlp").model.state_dict())
    assert ranks[1]["rank0_only_len"] == 0


def test_reset_parameters_agrees_across_ranks(ranks):
    a, b = ranks[0]["reset_state"], ranks[1]["reset_state"]
    assert set(a) == {"weight", "bias"}
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------
# single process (world size 1: no process group needed)


def test_single_process_without_distributed():
    assert not dist.is_initialized()
    case = build("mlp")
    ref = copy.deepcopy(case.model)
    model = FSDP(case.model)
    x, _ = case.make_batch(0, 4)
    assert torch.equal(model(x), ref(x))
    assert model.world_size == 1 and model.compute_device == torch.device("cpu")


def test_flatten_parameters_false_keeps_names():
    case = build("mlp")
    names = [n for n, _ in case.model.named_parameters()]
    model = FSDP(case.model, flatten_parameters=False)
    got = [n.replace("_fsdp_wrapped_module._fpw_module.", "") for n, _ in model.named_parameters()]
    assert got == names


def test_world_one_without_flattening_keeps_each_parameter_whole():
    """At world size 1 FairScale 0.4.13 shards nothing, so ``flatten_parameters=False`` leaves every
    parameter in its own shape: ``p.ndim`` (weight decay for matrices only), the gradients, the
    optimizer's state and its full state dict are shaped as without FSDP (ours had 1-D shards)."""
    case = build("mlp")
    ref = copy.deepcopy(case.model)
    shapes = [tuple(p.shape) for p in ref.parameters()]
    model = FSDP(case.model, flatten_parameters=False)
    assert [tuple(p.shape) for p in model.parameters()] == shapes
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (ref, model)]
    for step in range(2):
        x, y = case.make_batch(step, 4)
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            case.loss_fn(m(x), y).backward()
            opt.step()
    assert [tuple(p.grad.shape) for p in model.parameters()] == shapes
    assert [tuple(s["exp_avg"].shape) for s in opts[1].state_dict()["state"].values()] == shapes
    got = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, msg=k)
    full = model.gather_full_optim_state_dict(opts[1])
    assert [tuple(s["exp_avg"].shape) for s in full["state"].values()] == shapes
    opts[1].load_state_dict(model.get_shard_from_optim_state_dict(full))
    with model.summon_full_params():
        assert [tuple(p.shape) for p in model.parameters()] == shapes
    for m, opt in zip((ref, model), opts):  # one more step from the state that went round
        x, y = case.make_batch(2, 4)
        opt.zero_grad()
        case.loss_fn(m(x), y).backward()
        opt.step()
    got = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, msg=k)


def test_mixed_precision_buffers_cast_and_restored():
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model = FSDP(m, mixed_precision=True, compute_dtype=torch.bfloat16)
    assert m[1].running_mean.dtype == torch.bfloat16
    out = model(torch.randn(3, 4))
    assert out.dtype == torch.bfloat16
    sd = model.state_dict()
    assert sd["1.running_mean"].dtype == torch.float32 and sd["0.weight"].dtype == torch.float32
    assert sd["1.num_batches_tracked"].dtype == torch.int64


def test_force_input_to_fp32():
    model = FSDP(nn.Linear(4, 2), force_input_to_fp32=True)
    assert model(torch.randn(3, 4).half()).dtype == torch.float32


def test_errors_name_the_fix():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available; leave compute_device unset"):
            FSDP(nn.Linear(2, 2), compute_device="cuda")
    with pytest.raises(ValueError, match="compute_dtype=torch.bfloat16 needs mixed_precision=True"):
        FSDP(nn.Linear(2, 2), compute_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup"):
        FSDP(nn.Linear(2, 2), process_group="world")
    model = FSDP(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="needs allow_reset_parameters=True"):
        model.reset_parameters()
    with model.summon_full_params():
        with pytest.raises(RuntimeError, match="forward inside summon_full_params"):
            model(torch.randn(1, 2))
    shared = nn.Linear(3, 3)
    seq = nn.Sequential(shared, nn.Linear(3, 3))
    seq[1].weight = shared.weight
    seq[0] = FSDP(seq[0])
    with pytest.raises(ValueError, match="parameter '1.weight' is shared with a nested instance"):
        FSDP(seq)


def test_modules_built_after_a_nested_instance_are_no_tie():
    """fairseq's way of building a model: each layer wrapped as it is made (``wrap(layer)`` under
    ``enable_wrap``), then the final norm and head, then the root. The layers' original
    parameters are freed once flattened, so CPython hands their ids to the parameters made next;
    the root took those for weights shared with a nested instance and refused the model."""
    for _ in range(5):  # ids are reused most of the time, not always: try a few models
        layers = nn.ModuleList([FSDP(nn.Linear(4, 4)) for _ in range(3)])
        net = nn.ModuleDict({"layers": layers, "norm": nn.LayerNorm(4), "head": nn.Linear(4, 2)})
        model = FSDP(net)
        assert sorted(model.state_dict()) == sorted(nn.ModuleDict({
            "layers": nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]), "norm": nn.LayerNorm(4),
            "head": nn.Linear(4, 2)}).state_dict())
    pickle.dumps(model)  # the weak references behind the tie check do not stop pickling


def test_named_parameters_without_flattening_are_the_modules_names():
    """FairScale 0.4.13 cleans named_parameters() of an instance that does not flatten (weight-decay
    groups are built from these names): 'embed.weight', not '_fsdp_wrapped_module._fpw_module.embed.weight';
    a nested flattening instance's parameter is 'layers.0.flat_param_0'. A flattening instance keeps
    the raw names outside summon_full_params, as 0.4.13 does."""
    net = nn.ModuleDict({"embed": nn.Embedding(5, 4), "layers": nn.ModuleList([FSDP(nn.Linear(4, 4))])})
    names = [n for n, _ in FSDP(net, flatten_parameters=False).named_parameters()]
    assert names == ["embed.weight", "layers.0.flat_param_0"]
    names = [n for n, _ in FSDP(nn.Linear(2, 2)).named_parameters()]
    assert names == ["_fsdp_wrapped_module.flat_param_0"]


def test_unapplied_options_warn_once():
    fsdp_mod._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FSDP(nn.Linear(2, 2), bucket_cap_mb=50)
        FSDP(nn.Linear(2, 2), bucket_cap_mb=50)
    texts = [str(w.message) for w in caught]
    assert sum("bucket_cap_mb=50 is not applied" in t for t in texts) == 1
    with pytest.raises(ValueError, match="gradient_predivide_factor must be > 0"):
        FSDP(nn.Linear(2, 2), gradient_predivide_factor=0.0)


def test_tied_weights_in_one_instance():
    case = build("gpt", layers=1)
    ref = copy.deepcopy(case.model)
    model = FSDP(case.model)
    sd = model.state_dict()
    assert set(sd) == set(ref.state_dict())
    assert torch.equal(sd["lm_head.weight"], sd["wte.weight"])
    ids, _ = case.make_batch(0, 2)
    assert torch.allclose(model(ids), ref(ids), atol=1e-6)


def test_plain_parent_saves_and_loads_full_keys():
    ref = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    model = copy.deepcopy(ref)
    model[0], model[2] = FSDP(model[0]), FSDP(model[2])
    assert list(model.state_dict()) == list(ref.state_dict())
    torch.manual_seed(5)
    other = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    assert not model.load_state_dict(other.state_dict()).missing_keys
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in other.state_dict().items())
    partial = dict(other.state_dict())
    partial.pop("2.bias")
    partial["0.extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "2.bias"[\s\S]*Unexpected key\(s\) in state_dict: "0.extra"'):
        model.load_state_dict(partial)


class _WithScale(nn.Module):
    """A scalar parameter first in its module (registered before the layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale


@pytest.mark.parametrize("flatten", [True, False])
def test_a_scalar_parameters_optimizer_state_goes_round_and_trains_on(flatten: bool) -> None:
    """The optimizer state's round trip (gather_full_optim_state_dict, get_shard_from_optim_state_dict)
    judged a key by the unit's first member: a scalar parameter's exp_avg is 0-dim, so the whole
    flattened unit's exp_avg came back as that one number, and the next Adam step raised 'output with
    shape [] doesn't match the broadcast shape [52]' (flatten_parameters=False too, before 35a3a25
    left world-1 parameters whole)."""
    torch.manual_seed(0)
    ref = _WithScale()
    model = FSDP(copy.deepcopy(ref), flatten_parameters=flatten)
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (ref, model)]

    def step(k: int) -> None:
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            opt.step()

    step(0)
    step(1)
    full = model.gather_full_optim_state_dict(opts[1])
    if flatten:  # the scalar's own piece of the flat state (unflattened at world 1: 0.4.13's per-rank list)
        assert full["state"][0]["exp_avg"].shape == ()
    opts[1].load_state_dict(model.get_shard_from_optim_state_dict(full))
    step(2)
    got = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, msg=k)
