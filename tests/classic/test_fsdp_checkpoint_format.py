"""FSDP checkpoints in FairScale 0.4.13's format: local_state_dict keys, local_metadata_dict layout,
consolidate_shard_weights on metadata written by 0.4.13 (fairseq's separately saved experts), a
subclass whose state_dict() is local_state_dict(), stand-in process groups, and the wrapping
policy's FORCE_LEAF_MODULES."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from fairscale.fair_dev.testing.testing import DummyProcessGroup
from fairscale.nn import FullyShardedDataParallel as FSDP
from fairscale.nn import auto_wrap, default_auto_wrap_policy, enable_wrap
from fairscale.nn.misc import FlattenParamsWrapper


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    m[2] = FSDP(m[2], flatten_parameters=False)
    return FSDP(m)


def test_local_keys_and_metadata_have_the_0413_layout():
    model = _model()
    local = model.local_state_dict()
    assert list(local) == ["flat_param_0", "1.running_mean", "1.running_var", "1.num_batches_tracked",
                           "2.weight", "2.bias"]
    meta = model.local_metadata_dict()
    root, inner = meta["param_metadata"]
    assert root["fsdp_path"] == "" and inner["fsdp_path"] == "2"
    assert root["params"]["flat_param_0"] == {"names": ["0.weight", "0.bias", "1.weight", "1.bias"],
                                              "shapes": [(4, 3), (4,), (4,), (4,)], "numels": [12, 4, 4, 4],
                                              "padding": 0}
    assert set(inner["params"]) == {"weight", "bias"}
    assert meta["buffer_names"] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    full = FSDP.consolidate_shard_weights([local], [meta])
    want = {k: v for k, v in model.state_dict().items()}
    assert set(full) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=0)
    # and back: the clean keys load, as do the wrapper keys
    other = _model()
    with torch.no_grad():
        other.params[0].zero_()
    other.load_local_state_dict(local)
    torch.testing.assert_close(other.params[0], model.params[0])


def test_consolidates_metadata_written_by_0413():
    """fairseq saves MoE experts apart from the rest: the metadata of every instance is present
    but the weights of one only; with strict=False the rest is skipped, and an instance with
    no_broadcast_optim_state is rank-local (its first shard is the whole tensor)."""
    path = "decoder.layers.1.moe_layer.experts.0"
    meta = {
        "param_metadata": [
            {"fsdp_path": "", "params": {"flat_param_0": {"names": ["missing"], "shapes": [(12, 4)],
                                                          "numels": [48], "padding": 0}},
             "no_broadcast_optim_state": False, "shared_param_info": []},
            {"fsdp_path": path, "params": {"flat_param_0": {
                "names": ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"],
                "shapes": [(4, 4), (4,), (4, 4), (4,)], "numels": [16, 4, 16, 4], "padding": 0}},
             "no_broadcast_optim_state": True, "shared_param_info": []},
        ],
        "buffer_names": ["missing.buffer"],
    }
    flat = torch.arange(40, dtype=torch.float16)
    weights = {f"{path}.flat_param_0": flat}
    with pytest.raises(KeyError, match="'flat_param_0' missing"):
        FSDP.consolidate_shard_weights([weights], [meta])
    full = FSDP.consolidate_shard_weights([weights], [meta], strict=False)
    assert sorted(full) == sorted(f"{path}.{n}" for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    torch.testing.assert_close(full[f"{path}.fc2.bias"], flat[36:40])
    # two ranks, the second shard padded by 2: padding is dropped before the split
    meta2 = [{"param_metadata": [{"fsdp_path": "", "params": {"flat_param_0": {
        "names": ["w", "b"], "shapes": [(2, 2), (2,)], "numels": [4, 2], "padding": pad}},
        "no_broadcast_optim_state": False, "shared_param_info": [("w", "tied.w")]}], "buffer_names": []}
        for pad in (0, 2)]
    shards = [{"flat_param_0": torch.tensor([1.0, 2, 3, 4])}, {"flat_param_0": torch.tensor([5.0, 6, 0, 0])}]
    full = FSDP.consolidate_shard_weights(shards, meta2)
    torch.testing.assert_close(full["w"], torch.tensor([[1.0, 2], [3, 4]]))
    torch.testing.assert_close(full["b"], torch.tensor([5.0, 6]))
    assert full["tied.w"] is full["w"]


def test_subclass_state_dict_calling_local_state_dict_does_not_recurse():
    class Saved(FSDP):
        def state_dict(self, *args, **kwargs):  # fairseq-style: checkpoints are the local shards
            return self.local_state_dict(*args, **kwargs)

    model = Saved(nn.Linear(5, 5))
    assert list(model.state_dict()) == ["flat_param_0"]


def test_stand_in_process_group_of_one_and_force_leaf_modules():
    group = DummyProcessGroup(rank=0, size=1)
    policy = functools.partial(default_auto_wrap_policy, min_num_params=40,
                               force_leaf_modules=default_auto_wrap_policy.FORCE_LEAF_MODULES.union({nn.Linear}))
    with enable_wrap(wrapper_cls=FSDP, process_group=group, flatten_parameters=False):
        model = auto_wrap(nn.Sequential(nn.Linear(10, 10), nn.ModuleList([nn.Linear(10, 10)])),
                          auto_wrap_policy=policy)
    # Linear is a forced leaf (never recursed into, never wrapped on its own) and ModuleList is never
    # wrapped: the root, large enough, is the only instance
    assert isinstance(model, FSDP)
    assert isinstance(model.module[0], nn.Linear) and isinstance(model.module[1][0], nn.Linear)
    wrapped = FSDP(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)), process_group=group)
    assert isinstance(wrapped.module[0], nn.Linear)  # FSDP(seq).module[0]: FlattenParamsWrapper indexes
    x = torch.randn(2, 10)
    assert wrapped(x).shape == (2, 10)
    with pytest.raises(TypeError, match="a stand-in group can only have size 1"):
        FSDP(nn.Linear(2, 2), process_group=DummyProcessGroup(rank=0, size=2))


def test_flatten_params_wrapper_names_and_flat_state_dict():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    fpw = FlattenParamsWrapper(m, param_list=[list(m[0].parameters()), list(m[1].parameters())],
                               flat_param_names=["a", "b"])
    assert fpw.flat_param_names == ["flat_param_a", "flat_param_b"]
    assert list(fpw.flat_state_dict()) == ["flat_param_a", "flat_param_b"]
    assert fpw.metadata(1) == (["1.weight", "1.bias"], [torch.Size([2, 3]), torch.Size([2])], [6, 2])
    with fpw.unflatten_params([torch.zeros(9), torch.ones(8)]):
        inside = fpw.state_dict()
    assert float(inside["0.weight"].abs().sum()) == 0 and float(inside["1.bias"].sum()) == 2
    for k, v in fpw.state_dict().items():  # outside the block, the flat parameters' own values again
        torch.testing.assert_close(v, ref[k])
    assert fpw[1] is m[1]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(4), nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class _Decoder(nn.Module):
    """fairseq's decoder shape: embeddings, layers, final norm, output projection tied to the embeddings."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 4)
        self.layers = nn.ModuleList([_Block() for _ in range(2)])
        self.ln = nn.LayerNorm(4)
        self.out = nn.Linear(4, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.ln(x))


def _train_two_steps(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for step in range(2):
        tokens = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        opt.step()
    return opt


def test_full_optimizer_state_has_the_0413_layout():
    """gather_full_optim_state_dict numbers the original parameters as 0.4.13 did (FairScale 0.4.13
    on 2 gloo ranks, this model: root first, then each nested instance, each in flattening order;
    param_id_map {0: 0, 1: 0, 2: 0, 3: 1, ..., 8: 1, 9: 2, ..., 14: 2}; step a Python float), not in
    the unwrapped model's parameters() order: a fairseq checkpoint written by 0.4.13 and resumed
    here had its final norm's Adam state put on the first layer's norm, silently."""
    plain = _Decoder()
    model = _Decoder()
    model.layers = nn.ModuleList([FSDP(layer) for layer in model.layers])
    model = FSDP(model)
    plain_opt, opt = _train_two_steps(plain), _train_two_steps(model)
    full = model.gather_full_optim_state_dict(opt)
    assert list(full) == ["param_groups", "state", "param_id_map", "uncollected_local_ids"]
    assert full["param_id_map"] == {**dict.fromkeys(range(3), 0), **dict.fromkeys(range(3, 9), 1),
                                    **dict.fromkeys(range(9, 15), 2)}
    assert full["uncollected_local_ids"] == [] and full["param_groups"][0]["params"] == list(range(15))
    names = ["embed.weight", "ln.weight", "ln.bias"] + [
        f"layers.{i}.{m}.{k}" for i in range(2) for m in ("ln", "fc1", "fc2") for k in ("weight", "bias")]
    plain_ids = {n: i for i, (n, _) in enumerate(plain.named_parameters())}
    plain_state = plain_opt.state_dict()["state"]
    for gid, name in enumerate(names):
        st = full["state"][gid]
        assert type(st["step"]) is float and st["step"] == 2.0
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(st[key], plain_state[plain_ids[name]][key], rtol=1e-5, atol=1e-7,
                                       msg=f"{name} {key}")
    # back into the shards: the optimizer's own state
    shard = model.get_shard_from_optim_state_dict(full)
    own = opt.state_dict()
    assert shard["param_groups"][0]["params"] == own["param_groups"][0]["params"] == [0, 1, 2]
    for lid, st in own["state"].items():
        assert shard["state"][lid]["step"] == 2.0
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(shard["state"][lid][key], st[key], rtol=0, atol=0)
    # a plain optimizer's state dict of the unwrapped model (what this package gathered before) still loads
    legacy = model.get_shard_from_optim_state_dict(plain_opt.state_dict())
    for lid, st in own["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(legacy["state"][lid][key], st[key], rtol=1e-5, atol=1e-7)
    # a state gathered from another wrapping is refused, not loaded onto the wrong parameters
    with pytest.raises(ValueError, match="state 'exp_avg' of 'layers.0.fc1.weight' has shape \\(4,\\), the parameter"):
        FSDP(_Decoder()).get_shard_from_optim_state_dict(full)
    with pytest.raises(ValueError, match="numbers 15 parameters but this model's FSDP instances hold 13"):
        FSDP(nn.Sequential(nn.Embedding(11, 4), _Block(), _Block())).get_shard_from_optim_state_dict(full)
