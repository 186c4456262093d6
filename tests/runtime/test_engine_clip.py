"""Gradient clipping in the engine on 8 real gloo ranks: ``train_step(batch, clip_norm=...)`` over
pp × dp × tp = 2 × 2 × 2 trains exactly like single-process ``torch.nn.utils.clip_grad_norm_``.

The global norm must count every element of the user's model once: tensor-parallel slices add
over tp, replicated parameters (layer norms, row-parallel biases) count once, ZeRO/FSDP shards add
over dp, stages add over pp, GPT's embedding tied to its head (one copy per stage) counts
once, and Mixtral's experts, split over ep groups of dp ranks, add over ep. A norm that missed or double-counted any of these would differ from the reference norm.

SGD with momentum, not Adam: Adam's update m/√v hardly depends on the gradients' scale, so it
would hide a wrong clipping coefficient in the parameters. ``CLIP`` is far below every step's norm
(asserted), so every step clips. One pp = 1 plan runs the plain loop instead (``loss.backward();
pm.clip_grad_norm_(CLIP); pm.optimizer.step()``). Float64 as in ``tests/test_parallelize.py``: any mistake shows
far above the 1e-10 / 1e-9 tolerances. All configurations of a family run in one launch.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fairscale
from fairscale.api import captured, parallelize
from fairscale.compile_check import checker_for
from fairscale.runtime.optim import DataParallelOptimizer, reduce_grad_norm
from fairscale.testing.models import build
from fairscale.testing.reference import Trajectory, compare, train_reference, start_again
from passes.ops import comm
from passes.ops.groups import PROCESS
from passes.layout import META_LAYOUT, TensorShard
from passes.dp.shard_data_parallel import shard_data_parallel_pass
from passes.tp.patterns import propose_tp_rules
from planner.capture import LossModule, capture
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage, TensorParallel
from planner.selectors import format_layers

STEPS, BATCH, LR, MOMENTUM = 3, 8, 0.1, 0.9
CLIP = 0.05

# name: (pp, dp, tp, ep, schedule, microbatches, dp kind, sequence parallel)
CONFIGS = {
    "2x2x2-1f1b-ddp": (2, 2, 2, 1, "1f1b", 2, "ddp", False),
    "2x2x2-1f1b-fsdp": (2, 2, 2, 1, "1f1b", 2, "fsdp", False),
    "2x2x2-gpipe-zero2-sp": (2, 2, 2, 1, "gpipe", 2, "zero2", True),
    "2x2x2-interleaved-zero1": (2, 2, 2, 1, "interleaved", 2, "zero1", False),
    "1x4x2-manual-zero2": (1, 4, 2, 1, "1f1b", 1, "zero2", False),  # loss.backward(); pm.clip_grad_norm_(CLIP)
    # the same loop with torch.nn.utils.clip_grad_norm_(pm.parameters(), CLIP) (fairscale.runtime.clip_guard)
    "1x4x2-manual-torch-zero2": (1, 4, 2, 1, "1f1b", 1, "zero2", False),
    "2x2x2-ep2-1f1b-zero2-sp": (2, 2, 2, 2, "1f1b", 2, "zero2", True),  # experts split over dp pairs
}

FAMILY_CONFIGS = {"gpt": [name for name, cfg in CONFIGS.items() if cfg[3] == 1],
                  "llama": ["2x2x2-1f1b-fsdp", "2x2x2-gpipe-zero2-sp", "2x2x2-interleaved-zero1"],
                  "mixtral": ["2x2x2-ep2-1f1b-zero2-sp"]}
SLOW = {("gpt", "2x2x2-1f1b-ddp"), ("gpt", "2x2x2-1f1b-fsdp"), ("gpt", "2x2x2-gpipe-zero2-sp"),
        ("llama", "2x2x2-gpipe-zero2-sp"), ("llama", "2x2x2-interleaved-zero1")}
"""GPT (tied embedding and head, biases) runs every dense configuration; Llama (no biases,
RMSNorm, grouped KV heads) the sharded kinds, to keep the launch short; Mixtral expert parallelism
(expert weights are ``TensorShard``s on axis "ep", added over the ep group, the same on the ranks
that replicate them). The ``SLOW`` pairs run with -m slow, in a launch of their own per family:
the default tier keeps each kind once (GPT interleaved-zero1 and the two manual loops, Llama
fsdp, Mixtral ep with zero2 and sequence parallelism)."""

TOLERANCES = {"mixtral": (1e-8, 1e-8)}
"""(rtol, atol) where looser than (1e-10, 1e-9): Mixtral's experts stay float32 (transformers'
grouped matmul has no float64 kernel) and their gradients sum the rows in another order under
ep (grouped by source rank), ~1e-9 relative; a miscounted expert would be off by far more."""


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _build(family: str):
    case = build(family, layers=4, **({"experts": 4} if family == "mixtral" else {}))
    case.model.to(torch.float64)
    if family == "mixtral":  # no float64 grouped-matmul kernel: experts stay float32
        for layer in case.model.model.layers:
            layer.mlp.experts.float()
    make = case.make_batch
    case.make_batch = lambda step, n: tuple(t.to(torch.float64) if t.is_floating_point() else t for t in make(step, n))
    return case


def _plan(graph, config) -> Plan:
    pp, dp, tp, ep, kind, micro, dp_kind, sp = config
    v = 2 if kind == "interleaved" else 1
    names = [layer.name for layer in graph.layers]
    blocks = [i for i, name in enumerate(names) if ".layers." in f".{name}."]
    n = pp * v
    cuts = [0] + [blocks[len(blocks) // n * k] for k in range(1, n)] + [len(names)]
    # experts are split over ep, so tensor parallelism leaves them whole (no "expert" style)
    rules = {k: v for k, v in propose_tp_rules(graph.gm, tp=tp, sequence_parallel=sp).rules.items() if v != "expert"}
    return Plan(mesh=Mesh(pp=pp, dp=dp, tp=tp, ep=ep),
                schedule=Schedule(kind=kind, microbatches=micro, virtual_stages=v, global_batch=BATCH),
                stages=[Stage(layers=format_layers(names[a:b])) for a, b in zip(cuts, cuts[1:])],
                tensor_parallel=TensorParallel(rules=rules, sequence_parallel=sp),
                data_parallel=DataParallel(kind=dp_kind, units="layers.*" if dp_kind == "fsdp" else ""))


def _reduce_on_ep_axis(rank: int) -> float:
    """reduce_grad_norm on an axis other than pp/dp/tp: "ep" groups of 2 ranks ({0,1}, {2,3}, ...)
    hold disjoint expert slices (added over ep), whole tensors are the same on every rank (once)."""
    groups = [dist.new_group([r, r + 1]) for r in range(0, dist.get_world_size(), 2)]
    before = PROCESS.get("ep")  # the process-wide binding; the module's mesh keeps its own
    comm.set_group("ep", groups[rank // 2])
    try:
        parts = {("ep",): torch.tensor(float((rank % 2 + 1) ** 2), dtype=torch.float64),  # squares 1 and 4
                 (): torch.tensor(4.0, dtype=torch.float64)}
        return float(reduce_grad_norm(parts))
    finally:
        comm.set_group("ep", before)


KINDS = ("ddp", "zero2", "fsdp")


def _marked_mlp(kind: str) -> tuple[torch.fx.GraphModule, DataParallelOptimizer]:
    """The mlp family on one dp rank, its first parameter recorded as slice 0 of 2 on axis "ep"."""
    case = build("mlp")
    graph = capture(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn, annotate=False)
    gm = shard_data_parallel_pass(graph.gm, DataParallel(kind=kind, units="layers.*" if kind == "fsdp" else ""),
                                  dp_index=0, dp_size=1)
    key, shape = next(iter(graph.param_shapes.items()))
    gm.meta[META_LAYOUT].tp[key] = TensorShard(key=key, global_shape=(2 * shape[0], *shape[1:]), dim=0, index=0,
                                               count=2, axis="ep")
    return gm, DataParallelOptimizer(gm, torch.optim.SGD, lr=0.1)


def _parts_with_ep_axis(rank: int) -> dict[str, dict[tuple[str, ...], float]]:
    """grad_norm_parts of :func:`_marked_mlp` per kind, with "ep" bound to a group of 2 ranks and
    dp unbound (each rank is its own dp = 1 world here)."""
    groups = [dist.new_group([r, r + 1]) for r in range(0, dist.get_world_size(), 2)]
    before = PROCESS.get("ep"), PROCESS.get("dp")
    comm.set_group("ep", groups[rank // 2])
    comm.set_group("dp", None)
    try:
        out = {}
        for kind in KINDS:
            gm, opt = _marked_mlp(kind)
            gm(*build("mlp").make_batch(0, BATCH)).backward()
            out[kind] = {k: float(v) for k, v in opt.grad_norm_parts().items()}
        return out
    finally:
        comm.set_group("ep", before[0])
        comm.set_group("dp", before[1])


def _train_all(rank: int, world: int, family: str, case: Any, plans: dict[str, Plan]) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, plan in plans.items():
        start_again(case.model)  # each plan from the model's initial weights
        pm = parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=plan,
                         optimizer=functools.partial(torch.optim.SGD, lr=LR, momentum=MOMENTUM))
        traj = Trajectory()
        for step in range(STEPS):
            batch = case.make_batch(step, BATCH)
            if "manual" in name:  # the plain PyTorch loop (pp = 1): this rank's dp slice, then the global mean
                loss = pm(*batch)
                loss.backward()
                if "torch" in name:  # what a PyTorch script writes: the global norm, not this rank's pieces'
                    norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), CLIP)
                else:
                    norm = pm.clip_grad_norm_(CLIP)
                traj.grad_norms.append(float(norm))
                pm.optimizer.step()
                pm.optimizer.zero_grad()
                mean = loss.detach().reshape(1).clone()
                dist.all_reduce(mean)  # tp ranks hold equal losses, so the world mean is the dp mean
                traj.losses.append(float(mean) / world)
            else:
                traj.losses.append(pm.train_step(batch, clip_norm=CLIP))
                traj.grad_norms.append(pm.last_grad_norm)
        traj.params = pm.state_dict()
        out[name] = traj
        if "torch" in name:  # a part of the rank's pieces is refused, saying what to call
            mine = list(pm.parameters())  # ZeRO may hold one flat bucket: then no proper subset exists
            out["pieces"] = len(mine)
            for wrong in ([*mine, torch.zeros(1, requires_grad=True)], mine[:1] if len(mine) > 1 else None):
                if wrong is None:
                    continue
                try:
                    torch.nn.utils.clip_grad_norm_(wrong, CLIP)
                except RuntimeError as e:
                    out.setdefault("refusals", []).append(str(e))
            # error_if_nonfinite: an inf on one rank's piece makes every rank raise, before any scaling
            pm(*case.make_batch(0, BATCH)).backward()
            if rank == 0:  # every gradient this rank holds: whichever piece of it the rank counts
                for p in mine:
                    p.grad.fill_(float("inf"))
            before = [p.grad.clone() for p in mine]
            try:
                torch.nn.utils.clip_grad_norm_(pm.parameters(), CLIP, error_if_nonfinite=True)
            except RuntimeError as e:
                out["nonfinite"] = str(e)
            out["unscaled"] = all(torch.equal(a, p.grad) for a, p in zip(before, mine))
            pm.optimizer.zero_grad()
        if name == next(iter(plans)):
            out["shared"], out["stages"] = dict(pm.program.shared), len(plan.stages)
            try:
                pm.train_step(case.make_batch(0, BATCH), clip_norm=0.0)
            except ValueError as e:
                out["error"] = str(e)
    out["ep"] = _reduce_on_ep_axis(rank)
    if family == "gpt":
        out["parts"] = _parts_with_ep_axis(rank)
    return out


@pytest.fixture(scope="module")
def runs():
    """(family, slow) -> (reference, per-rank results), one 8-rank launch per family and tier, made
    on first use."""
    cache: dict[tuple[str, bool], tuple[Trajectory, list[dict[str, object]]]] = {}

    def get(family: str, slow: bool = False) -> tuple[Trajectory, list[dict[str, object]]]:
        if (family, slow) not in cache:
            case = _build(family)
            graph = captured(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn)
            plans = {name: _plan(graph, CONFIGS[name]) for name in FAMILY_CONFIGS[family]
                     if ((family, name) in SLOW) == slow}
            for plan in plans.values():  # as after fairscale.search: the ranks inherit the model and the check's captures
                checker_for(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn).check(plan)
            reference = train_reference(lambda: _build(family), steps=STEPS, global_batch=BATCH, clip_norm=CLIP,
                                        optimizer=_sgd)
            cache[family, slow] = reference, fairscale.launch(_train_all, devices=8, args=(family, case, plans),
                                                              timeout_s=900)
        return cache[family, slow]

    return get


@pytest.mark.parametrize("family, config", [
    pytest.param(f, c, marks=pytest.mark.slow) if (f, c) in SLOW else (f, c)
    for f, names in FAMILY_CONFIGS.items() for c in names])
def test_clipped_3d_training_matches_single_process(runs, family, config):
    reference, results = runs(family, (family, config) in SLOW)
    assert min(reference.grad_norms) > 4 * CLIP, "clip_norm must be small enough that every step clips"
    got = results[0][config]
    rtol, atol = TOLERANCES.get(family, (1e-10, 1e-9))
    compare(reference, got, rtol=rtol, atol=atol)  # losses, pre-clip norms and parameters
    for rank, other in enumerate(results[1:], start=1):  # every rank reports the same norm and loss
        assert other[config].grad_norms == got.grad_norms, f"rank {rank} reported other norms"
        assert other[config].losses == got.losses, f"rank {rank} reported other losses"


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_tied_weight_is_held_by_both_stages(runs, family):
    """GPT's wte.weight/lm_head.weight have a copy on its first and last stage, so the exact norms
    above show the copies count once; llama's embedding and head are separate weights."""
    _, results = runs(family)
    for r in results:  # the first and the last stage (of four, for the interleaved schedule's chunks)
        assert r["shared"] == ({"wte.weight": [0, r["stages"] - 1]} if family == "gpt" else {})


def test_torch_clip_on_a_ranks_pieces_is_refused(runs):
    """Given part of pm.parameters() (or them and another tensor), torch.nn.utils.clip_grad_norm_
    raises instead of clipping by the norm of this rank's pieces."""
    _, results = runs("gpt")
    for r in results:
        assert len(r["refusals"]) == (2 if r["pieces"] > 1 else 1)
        assert all("Clip the whole model with pm.clip_grad_norm_(max_norm)" in e for e in r["refusals"])
        assert "some of a ParallelModule's parameters and other tensors" in r["refusals"][0]
        assert all("and other tensors" not in e for e in r["refusals"][1:])
        assert "non-finite, so it cannot be clipped" in r["nonfinite"] and r["unscaled"]
    # a tensor of no ParallelModule still goes to torch's own function
    from fairscale.runtime.clip_guard import clip_grad_norm_

    w = torch.ones(3, requires_grad=True)
    w.grad = torch.full((3,), 4.0)
    assert float(clip_grad_norm_([w], 1.0)) == pytest.approx(48 ** 0.5)
    assert float(w.grad.norm()) == pytest.approx(1.0, rel=1e-5)


def test_clip_norm_must_be_positive(runs):
    _, results = runs("gpt")
    assert all(r["error"] == "clip_norm = 0.0; it must be a positive number (or None for no clipping)"
               for r in results)


def test_any_shard_axis_adds_over_its_own_group(runs):
    _, results = runs("gpt")
    # per ep group: 1² + 2² = 5 from the slices, plus 4 from the whole tensors, counted once
    assert [r["ep"] for r in results] == [3.0] * 8


@pytest.mark.parametrize("kind", KINDS)
def test_parts_are_keyed_by_each_shards_own_axis(runs, kind):
    """A parameter marked as an "ep" slice lands in its own part (with "dp" for the sharded kinds),
    the others in the whole-tensor (or dp-shard) part, and the parts add up to the plain norm."""
    _, results = runs("gpt")
    parts = results[0]["parts"][kind]
    ref = build("mlp")
    LossModule(ref.model, ref.loss_fn)(*ref.make_batch(0, BATCH)).backward()
    grads = [p.grad for p in ref.model.parameters()]
    dp = ("dp",) if kind != "ddp" else ()
    assert sorted(parts) == sorted([dp, tuple(sorted(dp + ("ep",)))])
    assert parts[tuple(sorted(dp + ("ep",)))] == pytest.approx(float(grads[0].pow(2).sum()), rel=1e-6)
    assert sum(parts.values()) == pytest.approx(sum(float(g.pow(2).sum()) for g in grads), rel=1e-6)
    assert all(r["parts"] == results[0]["parts"] for r in results)


def test_unbound_slice_axis_is_refused():
    gm, opt = _marked_mlp("ddp")
    gm(*build("mlp").make_batch(0, BATCH)).backward()
    with pytest.raises(ValueError, match=re.escape(
            "is sliced 2 ways on axis 'ep', but that axis is bound to 1 rank(s); bind it with "
            "passes.ops.comm.set_group('ep', group)")):
        opt.grad_norm_parts()
