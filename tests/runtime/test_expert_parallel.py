"""Expert parallelism on real gloo ranks: Mixtral's experts split over the ep axis train exactly.

One 8-rank launch runs every plan (each rank loops over them); the reference is trained once in
the parent with hooks on the routers, so the bytes the all-to-alls move can be checked against the
routing that actually happened: per MoE layer and step a rank sends its rows for other ranks'
experts (dispatch), returns the rows it received (combine), and backward does both again.

The model is float64 with float32 experts (transformers' grouped matmul has no float64 kernel), as
in test_tensor_parallel.py, and is held to the same 1e-5. Adam runs at lr 1e-3: an expert weight's
gradient sums the same rows in another order (grouped by source rank), and at lr 1e-2 Adam turns
that float32 rounding in near-zero entries into ~4e-5 differences (see test_parallelize.py).

The default tier runs the two plans that cover every axis (ep alone with the byte count; pp × dp ×
tp × ep with sequence parallelism and ZeRO-2); FSDP with recompute and GPipe with ZeRO-1 run in
the slow tier.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import pytest
import torch

import fairscale
from fairscale.api import captured, parallelize
from fairscale.compile_check import checker_for
from fairscale.testing.models import Case, build
from fairscale.testing.reference import Trajectory, compare, train_reference, start_again
from passes.ops import comm
from passes.ep.shard_experts import ExpertParallelError, shard_experts_pass
from passes.layout import META_LAYOUT
from passes.tp.patterns import propose_tp_rules
from planner.plan import DataParallel, Mesh, Plan, PlanError, Schedule, Stage, TensorParallel
from planner.validate import validate_plan

STEPS, BATCH, LR, LAYERS, EXPERTS, DIM = 3, 8, 1e-3, 4, 4, 64

# name: (pp, dp, tp, ep, schedule, microbatches, dp kind, recompute, sequence parallel)
CONFIGS = {
    "1x8x1-ep4-ddp": (1, 8, 1, 4, "1f1b", 1, "ddp", {}, False),
    "2x2x2-ep2-1f1b-zero2-sp": (2, 2, 2, 2, "1f1b", 2, "zero2", {}, True),
}
SLOW_CONFIGS = {
    "1x4x2-ep4-fsdp-recompute": (1, 4, 2, 4, "1f1b", 1, "fsdp", {"model.layers.*": "full"}, False),
    "2x4x1-ep2-gpipe-zero1": (2, 4, 1, 2, "gpipe", 2, "zero1", {}, False),
}
COUNTED = "1x8x1-ep4-ddp"


def make_case() -> Case:
    case = build("mixtral", layers=LAYERS, experts=EXPERTS)
    case.model.to(torch.float64)
    for layer in case.model.model.layers:
        layer.mlp.experts.float()
    make = case.make_batch

    def batch(step: int, n: int) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(torch.float64) if t.is_floating_point() else t for t in make(step, n))

    def loss64(out: Any, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1))

    return dataclasses.replace(case, make_batch=batch, loss_fn=loss64)


def _plan(graph: Any, config: tuple) -> Plan:
    pp, dp, tp, ep, kind, micro, dp_kind, recompute, sp = config
    # the experts are split over ep: tensor parallelism leaves them whole (no 'expert' style)
    rules = {k: v for k, v in propose_tp_rules(graph.gm, tp=tp, sequence_parallel=sp).rules.items()
             if v != "expert"} if tp > 1 else {}
    stages = [Stage(layers="model.embed_tokens, model.layers.[0-1]"),
              Stage(layers="model.layers.[2-3], model.norm, lm_head")] if pp > 1 else []
    return Plan(mesh=Mesh(pp=pp, dp=dp, tp=tp, ep=ep),
                schedule=Schedule(kind=kind, microbatches=micro, global_batch=BATCH), stages=stages,
                tensor_parallel=TensorParallel(rules=rules, sequence_parallel=sp),
                data_parallel=DataParallel(kind=dp_kind, units="model.layers.*" if dp_kind == "fsdp" else ""),
                recompute=dict(recompute))


def _train_all(rank: int, world: int, case: Case, plans: dict[str, Plan]) -> dict[str, Any]:
    out = {}
    for name, plan in plans.items():
        start_again(case.model)  # each plan from the model's initial weights
        pm = parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=plan,
                         optimizer=functools.partial(torch.optim.Adam, lr=LR))
        comm.COUNTER.reset()
        losses = [pm.train_step(case.make_batch(step, BATCH)) for step in range(STEPS)]
        counted = comm.COUNTER.snapshot()
        code = "\n".join(sub.code for gm in pm.modules.values() for sub in gm.modules()  # recompute regions too
                         if isinstance(sub, torch.fx.GraphModule))
        out[name] = (Trajectory(losses=losses, params=pm.state_dict()), counted, code, pm.mesh.dp_index)
    return out


def _routed_reference() -> tuple[Trajectory, list[list[torch.Tensor]]]:
    """The single-process trajectory, and each step's top-k expert ids per MoE layer ([tokens, k])."""
    seen: list[torch.Tensor] = []

    def build_hooked() -> Case:
        case = make_case()
        for layer in case.model.model.layers:
            layer.mlp.gate.register_forward_hook(lambda mod, args, out: seen.append(out[2].detach().clone()))
        return case

    ref = train_reference(build_hooked, steps=STEPS, global_batch=BATCH, lr=LR)
    return ref, [seen[s * LAYERS:(s + 1) * LAYERS] for s in range(STEPS)]


def _run(configs: dict[str, tuple]) -> tuple[Trajectory, list[list[torch.Tensor]], list[dict[str, Any]]]:
    case = make_case()
    graph = captured(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn)
    plans = {name: _plan(graph, cfg) for name, cfg in configs.items()}
    for plan in plans.values():
        validate_plan(plan, graph, devices=8)
        # checked here, before the launch, as after fairscale.search: the ranks inherit the model and
        # the check's captures (parallelize never changes a model, so one model serves every plan)
        checker_for(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn).check(plan)
    ref, routing = _routed_reference()
    results = fairscale.launch(_train_all, devices=8, args=(case, plans), timeout_s=900)
    return ref, routing, results


@pytest.fixture(scope="module")
def runs():
    return _run(CONFIGS)


@pytest.fixture(scope="module")
def slow_runs():
    return _run(SLOW_CONFIGS)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_expert_parallel_matches_single_process(runs, config: str) -> None:
    _check(runs, config)


@pytest.mark.slow
@pytest.mark.parametrize("config", list(SLOW_CONFIGS))
def test_expert_parallel_with_fsdp_recompute_and_gpipe(slow_runs, config: str) -> None:
    _check(slow_runs, config)


def _check(runs: Any, config: str) -> None:
    ref, _, results = runs
    got, counted, code, _ = results[0][config]
    compare(ref, got)
    for rank, other in enumerate(results[1:], start=1):
        assert other[config][0].losses == got.losses, f"rank {rank} reported other losses"
    # it really was expert parallel: tokens moved by all-to-all on the ep axis
    assert "moe_dispatch" in code and "moe_combine" in code
    assert counted["all_to_all:ep"]["calls"] > 0


def test_all_to_all_bytes_equal_the_routing(runs) -> None:
    """Each rank's all-to-all bytes equal 2 × (rows it sent + rows it received) × row bytes per MoE
    layer and step, counted from the reference's routing of that rank's tokens."""
    _, routing, results = runs
    _, dp, _, ep, *_ = CONFIGS[COUNTED]
    tokens = BATCH // dp * 16  # seq 16
    per = EXPERTS // ep
    row = DIM * 4  # the experts are float32
    for rank_result in results:
        _, counted, _, d = rank_result[COUNTED]
        block, j = d // ep, d % ep
        expected = 0
        for step in range(STEPS):
            for layer in range(LAYERS):
                ids = routing[step][layer]  # [all tokens, k]
                owner = ids // per
                mine = owner[d * tokens:(d + 1) * tokens]
                sent = int((mine != j).sum())
                peers = [block * ep + q for q in range(ep) if q != j]
                received = sum(int((owner[p * tokens:(p + 1) * tokens] == j).sum()) for p in peers)
                expected += 2 * (sent + received) * row
        assert counted["all_to_all:ep"]["bytes"] == expected
        assert counted["all_to_all:ep"]["calls"] == 4 * LAYERS * STEPS
        # the experts' gradients are averaged over the dp/ep ranks holding the same experts
        inner = 2 * DIM  # Mixtral's intermediate size in the zoo
        expert_bytes = LAYERS * EXPERTS * (2 * inner * DIM + DIM * inner) * 4 // ep  # gate|up and down, float32
        n = dp // ep
        assert counted["all_reduce:ep_rep"]["bytes"] == pytest.approx(STEPS * 2 * (n - 1) / n * expert_bytes)


def test_rank_graph_structure() -> None:
    """Per MoE layer: one dispatch and one combine; expert weights hold E/ep experts, recorded as
    shards on the ep axis; the router and attention are untouched."""
    case = make_case()
    graph = captured(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn)
    gm = shard_experts_pass(graph.gm, Plan(mesh=Mesh(dp=2, ep=2)), ep_index=1, ep_size=2)
    calls = [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function" and hasattr(n.target, "__name__")]
    assert calls.count("moe_dispatch") == LAYERS and calls.count("moe_combine") == LAYERS
    layout = gm.meta[META_LAYOUT]
    shards = {k: s for k, s in layout.tp.items() if s.axis == "ep"}
    assert len(shards) == 2 * LAYERS and all(s.count == 2 and s.index == 1 and s.dim == 0 for s in shards.values())
    w = gm.get_parameter("model.model.layers.0.mlp.experts.gate_up_proj")
    full = case.model.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(w, full[EXPERTS // 2:])
    assert gm.get_parameter("model.model.layers.0.mlp.gate.weight").shape == (EXPERTS, DIM)
    assert graph.gm.get_parameter("model.model.layers.0.mlp.experts.gate_up_proj").shape[0] == EXPERTS  # intact


def test_errors_name_the_problem() -> None:
    case = make_case()
    graph = captured(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn)
    with pytest.raises(PlanError, match=r"mesh.ep: 3 does not divide mesh.dp \(4\)"):
        validate_plan(Plan(mesh=Mesh(dp=4, ep=3)), graph, devices=4)
    with pytest.raises(PlanError, match="mesh.ep: 8 does not divide the 4 experts of model.layers.0.mlp.experts"):
        validate_plan(Plan(mesh=Mesh(dp=8, ep=8)), graph, devices=8)
    with pytest.raises(PlanError, match="cannot also be split over tp"):
        validate_plan(Plan(mesh=Mesh(dp=2, tp=2, ep=2),
             tensor_parallel=TensorParallel(rules={"model.layers.*.mlp.experts": "expert"})), graph, devices=4)
    gpt = build("gpt")
    dense = captured(gpt.model, gpt.make_batch(0, 2), loss_fn=gpt.loss_fn)
    with pytest.raises(PlanError, match="has no mixture-of-experts layer"):
        validate_plan(Plan(mesh=Mesh(dp=2, ep=2)), dense, devices=2)
    with pytest.raises(ExpertParallelError, match="no mixture-of-experts layer"):
        shard_experts_pass(dense.gm, ep_index=0, ep_size=2)
    with pytest.raises(ExpertParallelError, match="does not divide the 4 experts"):
        shard_experts_pass(graph.gm, ep_index=0, ep_size=3)
    from fairscale.data_parallel import DataParallelRunner

    with pytest.raises(ValueError, match=r"runs pp=tp=ep=1 plans; this plan has mesh pp=1, tp=1, ep=2: use the full"):
        DataParallelRunner.build(graph, Plan(mesh=Mesh(dp=2, ep=2)))


def _save_or_resume(rank: int, world: int, case: Case, path: str, plan: Plan, save: bool) -> Any:
    pm = parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=plan,
                     optimizer=functools.partial(torch.optim.Adam, lr=LR))
    if save:
        losses = [pm.train_step(case.make_batch(step, BATCH)) for step in range(2)]
        pm.save_checkpoint(path)
        return losses
    pm.load_checkpoint(path)
    return [pm.train_step(case.make_batch(step, BATCH)) for step in range(2, 4)], pm.state_dict()


def test_checkpoint_resumes_across_expert_layouts(tmp_path) -> None:
    """Saved with the experts split 4 ways (ZeRO-2 for the rest), resumed with them whole on 2 ranks:
    the same trajectory as one process, Adam moments included (each rank saves only its experts'
    moments, gathered over ep)."""
    split = Plan(mesh=Mesh(dp=4, ep=4), schedule=Schedule(global_batch=BATCH), data_parallel=DataParallel(kind="zero2"))
    whole = Plan(mesh=Mesh(dp=2), schedule=Schedule(global_batch=BATCH))
    path = str(tmp_path / "ckpt")
    case = make_case()  # one model, built and checked here: both launches inherit it and the check's captures
    for plan in (split, whole):
        checker_for(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn).check(plan)
    first = fairscale.launch(_save_or_resume, devices=4, args=(case, path, split, True))[0]
    rest, params = fairscale.launch(_save_or_resume, devices=2, args=(case, path, whole, False))[0]
    ref = train_reference(make_case, steps=4, global_batch=BATCH, lr=LR)
    compare(ref, Trajectory(losses=first + rest, params=params))


def test_a_body_that_is_not_row_wise_is_refused() -> None:
    """An expert body op that mixes rows (here a split along the rows) names itself."""
    case = make_case()
    graph = captured(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn)
    gm = torch.fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph))
    chunk = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.chunk.default
                 and "experts" in str(n.meta.get("fs_module", "")))
    chunk.args = (chunk.args[0], 2, 0)
    with pytest.raises(ExpertParallelError, match=r"%chunk.* splits along a dim other than the last"):
        shard_experts_pass(gm, ep_index=0, ep_size=2)


def test_regroup_order_puts_rows_in_expert_then_source_order() -> None:
    from passes.ops.ep_ops import regroup_order

    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # received from 2 sources, for 3 local experts
    # as received: s0e0 s0e0 s0e2 | s1e0 s1e1 s1e1 s1e1 -> rows 0..6
    assert regroup_order(counts).tolist() == [0, 1, 3, 4, 5, 6, 2]
    gen = torch.Generator().manual_seed(0)
    for n, local in [(2, 2), (4, 2), (3, 3)]:
        counts = torch.randint(0, 5, (n, local), generator=gen)
        starts = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).view(n, local)
        loop = [torch.arange(int(starts[s, e]), int(starts[s, e] + counts[s, e])) for e in range(local) for s in range(n)]
        assert torch.equal(regroup_order(counts), torch.cat(loop))
