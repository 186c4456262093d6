"""Data-parallel features beyond the plain step: gradient accumulation (no_sync), global-norm
clipping, zero_grad semantics, mixed precision, prefetch, failures and error messages."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import fairscale
from fairscale.data_parallel import DataParallelRunner
from fairscale.runtime.optim import DataParallelOptimizer
from fairscale.testing.reference import Trajectory, compare, train_reference
from passes.ops import comm
from passes.dp.shard_data_parallel import shard_data_parallel_pass
from planner.capture import LossModule, capture
from planner.plan import DataParallel, Mesh, Plan

from dp_harness import GLOBAL_BATCH, KINDS, config, make_case

WORLD = 2


def _graph(family="gpt", dtype=torch.float64, world=WORLD, micro=1):
    case = make_case(family, dtype)
    return case, capture(case.model, case.make_batch(0, GLOBAL_BATCH // world // micro), loss_fn=case.loss_fn, annotate=False)


def _traj(losses, params):
    return Trajectory(losses, {k: torch.from_numpy(v) for k, v in params.items()})


def _reference_with_clip(family, max_norm, steps=3):
    case = make_case(family)
    wrapped = LossModule(case.model, case.loss_fn)
    opt = torch.optim.Adam(case.model.parameters(), lr=1e-2)
    out, norms = Trajectory(), []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = wrapped(*case.make_batch(step, GLOBAL_BATCH))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(case.model.parameters(), max_norm).item())
        opt.step()
        out.losses.append(loss.item())
    out.params = {k: v.detach().clone() for k, v in case.model.state_dict().items()}
    return out, norms


@pytest.fixture(scope="module")
def feature_runs():
    """One 2-rank launch: per kind, 2 microbatches per rank; clipping at 0.05; set_to_none=False."""
    case, graph = _graph(micro=2)
    case1, graph1 = _graph()

    def run(rank, world):
        out = {}
        for name in KINDS:
            r = DataParallelRunner.build(graph, config("gpt", name), torch.optim.Adam, lr=1e-2)
            comm.COUNTER.reset()
            losses = [r.train_step(case.make_batch(s, GLOBAL_BATCH), microbatches=2) for s in range(3)]
            calls = dict(comm.COUNTER.calls)
            out[("micro", name)] = (losses, {k: v.numpy() for k, v in r.full_state_dict().items()}, calls,
                                   len(r.optimizer.info.buckets), len(r.optimizer.info.units))
            r = DataParallelRunner.build(graph1, config("gpt", name), torch.optim.Adam, lr=1e-2)
            losses, norms = [], []
            for s in range(3):
                r.optimizer.zero_grad(set_to_none=False)
                loss = r.gm(*r_slice(case1.make_batch(s, GLOBAL_BATCH), rank, world))
                loss.backward()
                norms.append(r.optimizer.clip_grad_norm_(0.05).item())
                r.optimizer.step()
                losses.append(r._mean(loss.item()))
            state = {k: v.numpy() for k, v in r.full_state_dict().items()}
            r.train_step(case1.make_batch(3, GLOBAL_BATCH), clip_norm=0.05)  # step 4 through train_step
            out[("clip", name)] = (losses, state, norms + [r.last_grad_norm])
        return out

    return fairscale.launch(run, devices=WORLD)[0]


def r_slice(batch, rank, world):
    from fairscale.runtime.data_parallel import local_slice

    return local_slice(batch, rank, world)


@pytest.mark.parametrize("kind", list(KINDS))
def test_gradient_accumulation_reduces_once_and_matches(feature_runs, kind):
    ref = train_reference(lambda: make_case("gpt"), steps=3, global_batch=GLOBAL_BATCH)
    losses, params, calls, buckets, units = feature_runs[("micro", kind)]
    compare(ref, _traj(losses, params))
    reductions = {k: v for k, v in calls.items() if k.startswith(("all_reduce", "reduce_scatter"))}
    assert sum(reductions.values()) == 3 * (buckets or units)  # one per bucket/unit per step, not per microbatch


@pytest.mark.parametrize("kind", list(KINDS))
def test_global_norm_clipping_matches_torch(feature_runs, kind):
    ref, ref_norms = _reference_with_clip("gpt", 0.05)
    _, ref_norms4 = _reference_with_clip("gpt", 0.05, steps=4)
    losses, params, norms = feature_runs[("clip", kind)]
    assert norms[:3] == pytest.approx(ref_norms, rel=1e-9)
    assert norms[3] == pytest.approx(ref_norms4[3], rel=1e-9)  # train_step(clip_norm=) records last_grad_norm
    assert max(ref_norms) > 0.05  # clipping was active
    compare(ref, _traj(losses, params))


def test_mixed_precision_bf16_keeps_fp32_master_and_halves_gathers():
    """bf16 compute on a tiny MLP (CPU bf16 is slow): losses stay near fp32, master shards and their
    gradients are fp32, and all-gathers move bf16 (half the fp32 bytes)."""
    case, graph = _graph("mlp", torch.float32)
    ref = train_reference(lambda: make_case("mlp", torch.float32), steps=3, global_batch=GLOBAL_BATCH)

    def run(rank, world):
        out = {}
        for name in ("fsdp_reshard", "zero2", "ddp"):
            cfg = config("mlp", name, param_dtype="bf16", reduce_dtype="fp32")
            r = DataParallelRunner.build(graph, cfg, torch.optim.Adam, lr=1e-2)
            comm.COUNTER.reset()
            losses = [r.train_step(case.make_batch(s, GLOBAL_BATCH)) for s in range(3)]
            dtypes = {str(p.dtype) for p in r.optimizer.params} | {str(p.grad.dtype) for p in r.optimizer.params}
            units = [(u.padded, u.reshard) for u in r.optimizer.info.units]
            out[name] = (losses, dtypes, units, dict(comm.COUNTER.payload))
        return out

    res = fairscale.launch(run, devices=WORLD)[0]
    for name, (losses, dtypes, _, _) in res.items():
        assert losses == pytest.approx(ref.losses, rel=2e-2), name
        assert dtypes == {"torch.float32"}, name
    _, _, units, payload = res["fsdp_reshard"]
    # all-gathers in bf16 (2 bytes; twice per step for resharded units), reduce-scatters in fp32
    assert payload["all_gather:dp"] == 3 * sum((2 if rs else 1) * padded * 2 for padded, rs in units)
    assert payload["reduce_scatter:dp"] == 3 * sum(padded * 4 for padded, _ in units)


def test_prefetch_off_gives_identical_results():
    case, graph = _graph("gpt")

    def run(rank, world):
        out = []
        for prefetch in (True, False):
            r = DataParallelRunner.build(graph, config("gpt", "fsdp_reshard", prefetch=prefetch),
                                         torch.optim.Adam, lr=1e-2)
            out.append([r.train_step(case.make_batch(s, GLOBAL_BATCH)) for s in range(2)])
        return out

    on, off = fairscale.launch(run, devices=WORLD)[0]
    assert on == off


def test_a_rank_dying_mid_step_stops_the_others_with_a_clear_error():
    case, graph = _graph("mlp")

    def run(rank, world):
        r = DataParallelRunner.build(graph, config("mlp", "fsdp_reshard"), torch.optim.Adam, lr=1e-2)
        r.train_step(case.make_batch(0, GLOBAL_BATCH))
        if rank == 1:
            raise RuntimeError("rank 1 lost its GPU (simulated)")
        r.train_step(case.make_batch(1, GLOBAL_BATCH))  # rank 0 blocks in a collective
        return "unreachable"

    start = time.monotonic()
    with pytest.raises(fairscale.RankFailedError, match=r"(?s)rank 1 failed first.*lost its GPU \(simulated\)"):
        fairscale.launch(run, devices=WORLD, grace_s=2.0)
    assert time.monotonic() - start < 60


def test_errors_say_what_to_do():
    _, graph = _graph("mlp")
    with pytest.raises(ValueError, match="data_parallel.kind = 'zero3'; choose one of"):
        shard_data_parallel_pass(graph.gm, DataParallel(kind="zero3"), dp_index=0, dp_size=2)
    with pytest.raises(ValueError, match="offload needs kind zero1, zero2 or fsdp"):
        shard_data_parallel_pass(graph.gm, DataParallel(kind="ddp", offload=True), dp_index=0, dp_size=2)
    with pytest.raises(ValueError, match="'blocks.\\*' selects no module holding parameters"):
        shard_data_parallel_pass(graph.gm, DataParallel(kind="fsdp", units="blocks.*"), dp_index=0, dp_size=2)
    with pytest.raises(ValueError, match="param_dtype = 'fp8'; choose one of"):
        shard_data_parallel_pass(graph.gm, DataParallel(kind="fsdp", param_dtype="fp8"), dp_index=0, dp_size=2)
    with pytest.raises(ValueError, match="plan.mesh.dp = 1 but dp_size = 2"):
        shard_data_parallel_pass(graph.gm, Plan(data_parallel=DataParallel(kind="zero2")), dp_index=0, dp_size=2)
    plan = Plan(mesh=Mesh(dp=2), data_parallel=DataParallel(kind="zero2"))
    gm = shard_data_parallel_pass(graph.gm, plan, dp_index=0, dp_size=2)
    with pytest.raises(ValueError, match="LBFGS may not be elementwise; kind='zero2' shards"):
        DataParallelOptimizer(gm, torch.optim.LBFGS, lr=1.0)
    from fairscale.runtime.data_parallel import local_slice

    with pytest.raises(ValueError, match="8 rows, which does not divide over 3 data-parallel ranks"):
        local_slice((torch.zeros(8, 2),), 0, 3)


def test_replicated_parameters_inside_sharded_kinds():
    """``replicate=`` keeps the tied embedding whole (full averaged p.grad after backward, as a
    pipeline needs to sum tied copies) while the rest is sharded; training with clipping still
    matches one process."""
    case, graph = _graph()
    ref, ref_norms = _reference_with_clip("gpt", 0.05)

    def run(rank, world):
        out = {}
        for name in ("zero1", "zero2", "fsdp_reshard"):
            gm = shard_data_parallel_pass(graph.gm, config("gpt", name), dp_index=rank, dp_size=world,
                                          replicate={"lm_head.weight"})
            comm.set_group("dp", torch.distributed.group.WORLD)
            opt = DataParallelOptimizer(gm, torch.optim.Adam, lr=1e-2)
            info = opt.info
            assert [b.kind for b in info.buckets if b.kind == "ddp"] == ["ddp"]
            assert sorted(k for b in info.buckets if b.kind == "ddp" for k in b.keys) == ["wte.weight"]
            losses, norms = [], []
            for s in range(3):
                opt.zero_grad(set_to_none=True)
                loss = gm(*r_slice(case.make_batch(s, GLOBAL_BATCH), rank, world))
                loss.backward()
                whole = info.plain_params()[0]
                assert whole.grad is not None and whole.grad.shape == (256, 64)
                norms.append(opt.clip_grad_norm_(0.05).item())
                opt.step()
                t = torch.tensor([loss.item()], dtype=torch.float64)
                torch.distributed.all_reduce(t)
                losses.append(t.item() / world)
            from fairscale.runtime.state import full_state_dict

            out[name] = (losses, {k: v.numpy() for k, v in full_state_dict(gm, aliases=graph.tied).items()}, norms)
        return out

    for name, (losses, params, norms) in fairscale.launch(run, devices=WORLD)[0].items():
        assert norms == pytest.approx(ref_norms, rel=1e-9), name
        compare(ref, _traj(losses, params))
    with pytest.raises(ValueError, match=r"replicate names \['nope'\], which this graph does not train"):
        shard_data_parallel_pass(graph.gm, config("gpt", "zero2"), dp_index=0, dp_size=2, replicate={"nope"})


def test_runner_refuses_a_non_gloo_process_group():
    """DataParallelRunner is the CPU path: under another backend it says to use the full engine."""
    _, graph = _graph()

    def run(rank, world):
        import torch.distributed as dist

        real = dist.get_backend
        dist.get_backend = lambda group=None: "nccl"  # what a GPU launch would report
        try:
            DataParallelRunner.build(graph, DataParallel(kind="ddp"))
        except NotImplementedError as exc:
            return str(exc)
        finally:
            dist.get_backend = real
        return "built"

    message = fairscale.launch(run, devices=1)[0]
    assert message.startswith("DataParallelRunner runs CPU ranks on gloo; this process group uses 'nccl'")
    assert "GPU placement belongs to the full engine" in message
