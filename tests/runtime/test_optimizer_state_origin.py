"""``pm.optimizer.state_dict()`` saved on rank 0 and loaded on every rank, as nanoGPT's train.py
checkpoints (``torch.save({'model': ..., 'optimizer': optimizer.state_dict()})`` on the master
process, ``optimizer.load_state_dict(checkpoint['optimizer'])`` on every rank when it resumes).

Under tensor parallelism tp rank 1 took rank 0's Adam moments for its own slices and trained on,
silently (a tiny LM's losses 2.7e-3 off one process three steps after the resume); under ZeRO-2
and pipeline parallelism it crashed inside torch.optim. The state dict now records where it came
from (``fairscale.runtime.stage_optimizers.optimizer_origin``) and a rank that holds other slices
or shards, or runs another plan, refuses it, saying how to resume; DDP replicas hold the same
state, so rank 0's still loads on all of them, and a rank's own state round-trips exactly.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.runtime.stage_optimizers import check_origin
from planner.plan import Mesh, Plan, TensorParallel

SEQ, VOCAB = 4, 16


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + self.down(F.gelu(self.up(h)))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _LM().double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (4, SEQ), generator=g), torch.randint(0, VOCAB, (4, SEQ), generator=g)


def _rank(rank: int, world: int, path: str) -> dict[str, object]:
    out: dict[str, object] = {}
    tp = TensorParallel(rules={"up": "colwise", "down": "rowwise"})
    for name, plan in (("tp2", Plan(mesh=Mesh(tp=2), tensor_parallel=tp)), ("dp2", Plan(mesh=Mesh(dp=2)))):
        pm = fairscale.parallelize(_model(), example_inputs=_batch(0), plan=plan,
                                   optimizer=functools.partial(torch.optim.Adam, lr=1e-2))
        pm.train_step(_batch(0))
        own = pm.optimizer.state_dict()
        if rank == 0:
            torch.save(own, path)
        dist.barrier()
        saved = torch.load(path, weights_only=False)
        dist.barrier()
        if rank == 0:
            os.unlink(path)
        try:
            pm.optimizer.load_state_dict(saved)
            out[name] = "loaded"
        except ValueError as e:
            out[name] = str(e)
        pm.optimizer.load_state_dict(own)  # a rank's own state round-trips
        out[name + " losses"] = [pm.train_step(_batch(s)) for s in (1, 2)]
        pm.close()
    return out


def _one_process() -> list[float]:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for s in range(3):
        loss = model(*_batch(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses[1:]


def test_rank_0s_optimizer_state_is_refused_where_ranks_hold_other_slices(tmp_path) -> None:
    results = fairscale.launch(_rank, devices=2, args=(str(tmp_path / "optimizer.pt"),))
    want = _one_process()
    assert results[0]["tp2"] == "loaded" and results[0]["dp2"] == "loaded"
    assert results[1]["dp2"] == "loaded"  # DDP replicas hold the same state
    refusal = results[1]["tp2"]
    assert "saved by rank 0 (pp 0, dp 0, tp 0)" in refusal and "this is rank 1 (pp 0, dp 0, tp 1)" in refusal
    assert "holds other slices or shards" in refusal and "pm.save_checkpoint(dir)" in refusal
    for r in results:
        for name in ("tp2", "dp2"):
            assert r[name + " losses"] == pytest.approx(want, rel=1e-12)


def test_another_plans_optimizer_state_is_refused() -> None:
    mine = {"layout": "a", "shard": [0, None, 0], "rank": 0, "coords": [0, 0, 0], "plan": "pp1 x dp2 x tp1, ddp"}
    other = dict(mine, layout="b", plan="pp1 x dp1 x tp2, ddp")
    with pytest.raises(ValueError, match="another plan lays the optimizer state out otherwise"):
        check_origin(other, mine)
    check_origin(dict(mine, rank=1, coords=[0, 1, 0]), mine)  # a DDP replica's
    check_origin(None, mine)  # a state dict without an origin is taken as it is
