"""The global-batch contract (fairscale.runtime.batch_check): ranks given different batches on the
first step fail on every rank, naming the ranks; the same batch passes (issue 12, item 4)."""

from __future__ import annotations

import pytest
import torch

import fairscale
from fairscale.runtime.batch_check import BatchMismatchError, batch_fingerprint
from fairscale.runtime.launch import RankFailedError
from fairscale.testing.models import build


def _train(rank: int, world: int, shard: bool) -> str:
    case = build("mlp")
    batch = case.make_batch(0, 8)
    pm = fairscale.parallelize(case.model, example_inputs=batch, loss_fn=case.loss_fn)
    if shard:  # what a DistributedSampler loop hands each rank
        batch = case.make_batch(rank + 1, 8) if rank >= 2 else batch
    try:
        pm.train_step(batch)
        pm.train_step(case.make_batch(1 + rank, 8))  # later batches are not checked (no collective)
    except BatchMismatchError as exc:
        return str(exc)
    return "trained"


def test_different_batches_fail_on_every_rank_and_the_same_batch_trains() -> None:
    assert fairscale.launch(_train, devices=4, args=(False,)) == ["trained"] * 4
    out = fairscale.launch(_train, devices=4, args=(True,))
    assert len(set(out)) == 1 and out[0].startswith("ranks [2, 3] were given a different global batch than rank 0")
    assert "DistributedSampler" in out[0]


def test_the_fingerprint_sees_a_permutation_and_a_dtype_of_the_same_values() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    assert not torch.equal(batch_fingerprint((x,)), batch_fingerprint((x.flip(0),)))
    assert torch.equal(batch_fingerprint((x, torch.tensor([1, 2]))), batch_fingerprint((x.clone(), torch.tensor([1, 2]))))
