"""A training script written the way FairScale 0.4.13's documentation shows FSDP (nested wrapping
with enable_wrap/wrap/auto_wrap, activation checkpointing, a plain optimizer loop, a rank-0
checkpoint), run unchanged on 2 and 4 gloo ranks and checked against the same model trained in
one process."""

from __future__ import annotations

import functools
import io
import os
import tempfile

import pytest
import torch
from torch import nn

import fairscale

STEPS, BATCH = 3, 8


# ------------------------------------------------------------------------------------------------
# the user's code, as a FairScale user would have written it

class TransformerBlock(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class MyModule(nn.Module):
    def __init__(self, fsdp_params=None) -> None:
        super().__init__()
        from fairscale.nn.checkpoint.checkpoint_activations import checkpoint_wrapper
        from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
        from fairscale.nn.wrap import auto_wrap, default_auto_wrap_policy, enable_wrap, wrap

        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        blocks = [TransformerBlock() for _ in range(3)]
        self.head = nn.Linear(16, 4)
        if fsdp_params is None:  # the single-process baseline
            self.blocks = nn.Sequential(*blocks)
            return
        my_auto_wrap_policy = functools.partial(default_auto_wrap_policy, min_num_params=1000)
        with enable_wrap(wrapper_cls=FSDP, **fsdp_params):
            # wraps the layer in FSDP by default if within context
            self.embed = wrap(self.embed, flatten_parameters=False)
            assert isinstance(self.embed, FSDP)
            # separately wraps children modules with sub-modules
            self.blocks = auto_wrap(nn.Sequential(*[checkpoint_wrapper(b) for b in blocks]),
                                    auto_wrap_policy=my_auto_wrap_policy)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


def legacy_main(rank: int, world_size: int, checkpoint_path: str) -> list[float]:
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    fsdp_params = dict(mixed_precision=False, flatten_parameters=True, reshard_after_forward=True)
    model = FSDP(MyModule(fsdp_params), **fsdp_params)
    optim = torch.optim.Adam(model.parameters(), lr=0.0001)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        sample, label = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        per = BATCH // world_size
        sample, label = sample[rank * per:(rank + 1) * per], label[rank * per:(rank + 1) * per]
        optim.zero_grad()
        out = model(sample)
        loss = criterion(out, label)
        loss.backward()
        model.clip_grad_norm_(10.0)
        optim.step()
        losses.append(loss.item())
    state = model.state_dict()  # every rank takes part; rank 0 writes
    if rank == 0:
        torch.save(state, checkpoint_path)
    return losses


# ------------------------------------------------------------------------------------------------


def _baseline() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = MyModule()
    optim = torch.optim.Adam(model.parameters(), lr=0.0001)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        sample, label = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        optim.zero_grad()
        loss = nn.functional.cross_entropy(model(sample), label)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        optim.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("world", [2, 4])
def test_legacy_script_runs_unchanged_and_matches_one_process(world):
    ref_losses, ref_state = _baseline()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint.pt")
        per_rank = fairscale.launch(legacy_main, devices=world, args=(path,))
        with open(path, "rb") as f:
            state = torch.load(io.BytesIO(f.read()), weights_only=True)
    for step, ref in enumerate(ref_losses):
        mean = sum(r[step] for r in per_rank) / world
        assert abs(mean - ref) <= 1e-5 * abs(ref), (step, mean, ref)
    assert set(state) == set(ref_state)
    init = MyModule().state_dict()
    for k, v in ref_state.items():
        assert (state[k] - v).abs().max() <= 1e-5, k
        assert (state[k] - init[k]).abs().max() >= 2e-4, f"{k} barely moved: the comparison would be vacuous"
