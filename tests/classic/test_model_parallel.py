"""fairscale.nn.model_parallel on gloo: layers and vocab-parallel loss train exactly like the dense model."""

from __future__ import annotations

import io

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: once here, not in every forked rank)
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.nn import model_parallel as mpu
from fairscale.nn.model_parallel import initialize as mpi
from fairscale.nn.model_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from passes.ops import comm

V, D, H, STEPS, BATCH, SEQ = 32, 16, 64, 3, 8, 6
PAD = 1


def _pack(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=False)


def _optimizer(params) -> torch.optim.Optimizer:
    # SGD with momentum, not Adam: Adam's per-element normalization turns last-bit differences of
    # near-zero gradients (sums over a different split) into visible weight differences
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, V, (BATCH, SEQ), generator=g)
    ids[:, 0] = PAD  # the padding row is looked up, and must get no gradient
    return ids, torch.randint(0, V, (BATCH, SEQ), generator=g)


class ParallelNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        keep = dict(keep_master_weight_for_test=True)
        self.emb = mpu.VocabParallelEmbedding(V, D, padding_idx=PAD, **keep)
        self.up = mpu.ColumnParallelLinear(D, H, gather_output=False, **keep)
        self.down = mpu.RowParallelLinear(H, D, input_is_parallel=True, **keep)
        self.col = mpu.ColumnParallelLinear(D, H, gather_output=True, **keep)  # gathered output
        self.row = mpu.RowParallelLinear(H, D, input_is_parallel=False, **keep)  # splits its input
        self.head = mpu.ColumnParallelLinear(D, V, bias=False, gather_output=False, **keep)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.down(F.gelu(self.up(h)))
        h = h + self.row(torch.tanh(self.col(h)))
        return mpu.vocab_parallel_cross_entropy(self.head(h), target).mean()


class DenseNet(nn.Module):
    def __init__(self, par: ParallelNet) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=PAD)
        self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)
        self.col, self.row = nn.Linear(D, H), nn.Linear(H, D)
        self.head = nn.Linear(D, V, bias=False)
        with torch.no_grad():
            for name in ("emb", "up", "down", "col", "row", "head"):
                dense, sharded = getattr(self, name), getattr(par, name)
                dense.weight.copy_(sharded.master_weight)
                if getattr(dense, "bias", None) is not None:
                    dense.bias.zero_()

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.down(F.gelu(self.up(h)))
        h = h + self.row(torch.tanh(self.col(h)))
        return F.cross_entropy(self.head(h).reshape(-1, V), target.reshape(-1))


def _gather_full(par: ParallelNet) -> dict[str, torch.Tensor]:
    """The dense-shaped parameters, gathered from the model-parallel ranks."""
    out = {}
    for name in ("up", "down", "col", "row", "head"):
        out[f"{name}.weight"] = getattr(par, name).get_master_weight()
    out["emb.weight"] = comm.gather_from_group(par.emb.weight.detach().t(), mpi.MODEL_AXIS, -1).t()
    for name in ("up", "col"):
        out[f"{name}.bias"] = comm.gather_from_group(getattr(par, name).bias.detach(), mpi.MODEL_AXIS, -1)
    for name in ("down", "row"):
        out[f"{name}.bias"] = getattr(par, name).bias.detach().clone()
    return out


def _train(mp: int) -> dict:
    mpu.initialize_model_parallel(mp)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    torch.manual_seed(0)
    par = ParallelNet()
    init = _gather_full(par)
    opt = _optimizer(par.parameters())
    losses = []
    per = BATCH // dp
    for step in range(STEPS):
        opt.zero_grad()
        ids, target = (t[dp_rank * per:(dp_rank + 1) * per] for t in _batch(step))
        loss = par(ids, target)
        loss.backward()
        for p in par.parameters():  # data parallelism across model-parallel replicas
            comm.all_reduce_(p.grad, mpi.DATA_AXIS)
            p.grad.div_(dp)
        opt.step()
        g = loss.detach().clone()
        comm.all_reduce_(g, mpi.DATA_AXIS)
        losses.append(g.item() / dp)
    out = {"losses": losses, "params": _gather_full(par), "init": init,
           "masters": {n: getattr(par, n).master_weight for n in ("emb", "up", "down", "col", "row", "head")},
           "mp": (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()),
           "dp": (dp_rank, dp), "bytes": comm.COUNTER.snapshot()}
    mpu.destroy_model_parallel()
    return out


def _run(rank: int, world: int) -> bytes:
    out = {f"mp{mp}": _train(mp) for mp in (2, world) if world % mp == 0}
    mpu.initialize_model_parallel(world)
    model_parallel_cuda_manual_seed(7)
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(4)
    out["rng"] = {"inside": inside, "outside": torch.rand(4)}
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(1, pipeline_length=2)
    out["layout"] = {"pipeline": mpu.get_pipeline_parallel_ranks(), "mp": mpu.get_model_parallel_world_size(),
                     "dp": mpu.get_data_parallel_world_size()}
    try:
        mpu.initialize_model_parallel(1)
    except RuntimeError as e:
        out["twice"] = str(e)
    mpu.destroy_model_parallel()
    try:
        mpu.initialize_model_parallel(3)
    except ValueError as e:
        out["indivisible"] = str(e)
    return _pack(out)


def _dense_reference(masters: dict[str, torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    class _Masters:  # DenseNet copies from objects with a .master_weight
        def __init__(self, w: torch.Tensor) -> None:
            self.master_weight = w

    holder = type("P", (), {n: _Masters(w) for n, w in masters.items()})()
    dense = DenseNet(holder)  # type: ignore[arg-type]
    opt = _optimizer(dense.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = dense(*_batch(step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in dense.state_dict().items()}


@pytest.fixture(scope="module", params=[2, 4])
def runs(request):
    return request.param, [_unpack(r) for r in fairscale.launch(_run, devices=request.param)]


def test_layers_train_like_dense(runs) -> None:
    world, results = runs
    for key in {k for k in results[0] if k.startswith("mp")}:
        losses, params = _dense_reference(results[0][key]["masters"])
        for r in results:
            got = r[key]
            assert got["losses"] == pytest.approx(losses, rel=1e-5)
            for name, v in params.items():
                torch.testing.assert_close(got["params"][name], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_padding_row_gets_no_update(runs) -> None:
    _, results = runs
    for r in results:
        for key in (k for k in r if k.startswith("mp")):
            torch.testing.assert_close(r[key]["params"]["emb.weight"][PAD], r[key]["init"]["emb.weight"][PAD])


def test_group_layout_and_getters(runs) -> None:
    world, results = runs
    for rank, r in enumerate(results):
        assert r[f"mp{world}"]["mp"] == (rank, world) and r[f"mp{world}"]["dp"] == (0, 1)
        assert r["mp2"]["mp"] == (rank % 2, 2) and r["mp2"]["dp"] == (rank // 2, world // 2)
        # pipeline groups: ranks that differ only in the pipeline index
        assert r["layout"]["mp"] == 1 and r["layout"]["dp"] == world // 2
        assert rank in r["layout"]["pipeline"] and len(r["layout"]["pipeline"]) == 2
        assert "already initialized" in r["twice"]
        assert "must divide the world size" in r["indivisible"]


def test_collectives_go_through_comm(runs) -> None:
    world, results = runs
    snap = results[0][f"mp{world}"]["bytes"]
    assert snap["all_reduce:model_parallel"]["calls"] > 0
    assert snap["all_gather:model_parallel"]["calls"] > 0


def test_uninitialized_getter_says_what_to_call() -> None:
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        mpu.get_model_parallel_rank()


def test_model_parallel_rng_streams(runs) -> None:
    world, results = runs
    outside = [r["rng"]["outside"] for r in results]
    inside = [r["rng"]["inside"] for r in results]
    assert all(torch.equal(o, outside[0]) for o in outside)  # the default stream agrees everywhere
    assert len({tuple(t.tolist()) for t in inside}) == world  # the tracked stream differs per rank
    torch.manual_seed(7)
    torch.testing.assert_close(outside[0], torch.rand(4))  # forking did not advance the default stream
