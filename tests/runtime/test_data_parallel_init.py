"""Initialization: meta model + seed gives the single-process weights; ranks that disagree are
caught, or synchronized from rank 0, before training."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import fairscale
from fairscale.data_parallel import DataParallelRunner
from fairscale.runtime.init import (ReplicaMismatchError, check_replicas, materialize_meta, materialize_sharded,
                                    sync_params)
from fairscale.testing.models import CNN, GPT, GPTConfig, MLPNet, build
from fairscale.testing.reference import Trajectory, compare, train_reference
from planner.capture import capture

from dp_harness import GLOBAL_BATCH, config


def _same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("family,cls", [("mlp", MLPNet), ("cnn", CNN)])
def test_meta_model_plus_seed_equals_single_process_init(family, cls):
    with torch.device("meta"):
        meta = cls()
    materialize_meta(meta, seed=0)
    _same(meta, build(family, seed=0).model)


def _gpt_init(model: nn.Module) -> None:
    """The custom initialization GPT.__init__ runs after building its layers (see testing/models.py)."""
    nn.init.normal_(model.wte.weight, std=0.02)
    nn.init.normal_(model.wpe.weight, std=0.02)
    for name, p in model.named_parameters():
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * model.cfg.layers))


def test_meta_gpt_with_its_custom_init_and_tied_head():
    with torch.device("meta"):
        meta = GPT(GPTConfig())
    materialize_meta(meta, seed=0, init_fn=_gpt_init)
    assert meta.lm_head.weight is meta.wte.weight
    _same(meta, build("gpt", seed=0).model)


def test_materialize_refuses_a_real_model():
    with pytest.raises(ValueError, match="expects a model built on the meta device"):
        materialize_meta(MLPNet(), seed=0)


def test_diverged_ranks_are_caught_or_synced_from_rank_0():
    case = build("mlp")
    graph = capture(case.model, case.make_batch(0, GLOBAL_BATCH // 2), loss_fn=case.loss_fn, annotate=False)
    ref = train_reference(lambda: build("mlp"), steps=2, global_batch=GLOBAL_BATCH)

    def run(rank, world):
        if rank == 1:  # as if rank 1 had built its model with another seed
            with torch.no_grad():
                next(graph.gm.parameters()).add_(1.0)
        with pytest.raises(ReplicaMismatchError, match="ranks start from different weights for 1 parameter"):
            DataParallelRunner.build(graph, config("mlp", "zero2"), torch.optim.Adam, lr=1e-2)
        r = DataParallelRunner.build(graph, config("mlp", "zero2"), torch.optim.Adam, lr=1e-2, sync=True)
        check_replicas(graph.gm)
        losses = [r.train_step(case.make_batch(s, GLOBAL_BATCH)) for s in range(2)]
        return losses, {k: v.numpy() for k, v in r.full_state_dict().items()}

    losses, params = fairscale.launch(run, devices=2)[0]
    compare(ref, Trajectory(losses, {k: torch.from_numpy(np.asarray(v)) for k, v in params.items()}))
    assert callable(sync_params)


def _gpt_param_init(key: str, t: torch.Tensor) -> bool:
    """GPT.__init__'s custom init, per parameter in named_parameters order (streaming form)."""
    if key in ("wte.weight", "wpe.weight"):
        nn.init.normal_(t, std=0.02)
        return True
    if key.endswith("o_proj.weight") or key.endswith("down_proj.weight"):
        nn.init.normal_(t, std=0.02 / math.sqrt(2 * GPTConfig().layers))
        return True
    return False


def test_sharded_materialization_of_a_meta_gpt_equals_single_process_init():
    """Capture the GPT on meta, compile each rank, then fill only this rank's shards module by
    module: the gathered weights equal ``torch.manual_seed(0); GPT()``, for every kind."""
    with torch.device("meta"):
        meta = GPT(GPTConfig())
    case = build("gpt", seed=0)
    expected = {k: v.numpy() for k, v in case.model.state_dict().items()}
    graph = capture(meta, case.make_batch(0, GLOBAL_BATCH // 2), loss_fn=case.loss_fn, annotate=False)

    def run(rank, world):
        out = {}
        for kind in ("fsdp_reshard", "zero2", "ddp"):
            r = DataParallelRunner.build(graph, config("gpt", kind), torch.optim.Adam, lr=1e-2)
            materialize_sharded(r.gm, meta, seed=0, param_init=_gpt_param_init)
            assert all(p.is_meta for p in meta.parameters())  # the skeleton never holds the model
            out[kind] = {k: v.numpy() for k, v in r.full_state_dict().items()}
            r.train_step(case.make_batch(0, GLOBAL_BATCH))  # and it trains
        return out

    for kind, got in fairscale.launch(run, devices=2)[0].items():
        assert set(got) == set(expected), kind
        for k, v in expected.items():
            np.testing.assert_array_equal(got[k], v, err_msg=f"{kind}: {k}")
