"""Pipeline parallelism on real gloo ranks: every schedule (GPipe, 1F1B, interleaved 1F1B, V-shape),
pp = 2 and 4, microbatches = pp and 2·pp,
on GPT (tied embeddings), Hugging Face Llama and a model with skip connections across stages,
plus pp × dp = 2 × 2 with the data-parallel pass. 3 Adam steps must match single-process training.

Exactness reference: single-process training with the same gradient accumulation (the global batch
cut into dp × microbatches pieces, each loss / pieces; tied weights summed as the pipeline sums
its copies, see ``accumulated_reference``). Full-batch training differs from *any* accumulated
run by up to ~1e-4 in a few parameters after 3 Adam steps (Adam's m/√v turns 1e-9 differences of
summation order in small gradients into visible steps), so parameters are compared with the
accumulated run at 1e-5 and the losses with both the accumulated and the full-batch run at 1e-5.

All configurations of one world size run in one launch (each rank loops over them); captures and
references are made once in the parent before the fork.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
import torch
from torch import nn

import fairscale.runtime as rt
from fairscale.runtime.mesh import build_mesh
from fairscale.runtime.pipeline import PipelineError, PipelineExecutor
from fairscale.testing.models import Case, build
from fairscale.testing.reference import Trajectory, compare, make_optimizer, train_reference
from passes.split_stages import split_stages_pass
from planner.capture import LossModule, capture
from planner.graph import ModelGraph
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage
from planner.schedule import build_schedule, schedule_for

GB = 8
STEPS = 3
KINDS = ("gpipe", "1f1b", "interleaved", "v")


MODELS: dict[str, Callable[[], Case]] = {
    "gpt": lambda: build("gpt"),                 # 8 layers: wte, wpe, layers.0-3, ln_f, lm_head
    "llama": lambda: build("llama", layers=5),   # 8 layers: embed_tokens, layers.0-4, norm, lm_head
    "skip": lambda: build("skip"),               # 8 layers: embed, blocks.0-5, head
}


def even_stages(graph: ModelGraph, n: int) -> list[Stage]:
    names = [layer.name for layer in graph.layers]
    assert len(names) >= n, f"{len(names)} layers cannot fill {n} stages"
    cuts = [round(i * len(names) / n) for i in range(n + 1)]
    return [Stage(layers=", ".join(names[cuts[i]:cuts[i + 1]])) for i in range(n)]


def accumulated_reference(build_case: Callable[[], Case], pieces: int, *, dp: int = 1) -> Trajectory:
    """Single-process training where each step accumulates ``pieces`` equal slices of the batch.

    With ``dp > 1`` the slices form ``dp`` consecutive groups (the data-parallel replicas); each
    group accumulates its own gradient (loss / slices per replica), and the step's gradient is
    the sum of the groups' divided by ``dp``, as the data-parallel all-reduce computes it.

    A tied parameter (GPT's wte/lm_head) is held as one copy per name, as the pipeline holds one
    per stage; after the step's backwards every copy gets the sum of the copies' gradients, first
    name first. This is the same arithmetic as one shared tensor except for the order of the
    gradient sum: with the shared tensor, autograd adds (embedding + head) per microbatch, and
    Adam turns that 1e-9 reassociation into ~1e-5 parameter differences after 3 steps. Untied, the
    pipeline reproduces this reference bitwise."""
    case = build_case()
    groups: dict[int, list[str]] = {}
    for name, p in case.model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    tied = [names for names in groups.values() if len(names) > 1]
    for names in tied:
        for name in names[1:]:
            mod_path, _, leaf = name.rpartition(".")
            mod = case.model.get_submodule(mod_path)
            setattr(mod, leaf, nn.Parameter(mod.get_parameter(leaf).detach().clone()))
    wrapped = LossModule(case.model, case.loss_fn)
    opt = make_optimizer(case.model.parameters())
    out = Trajectory()
    params = list(case.model.parameters())
    per = pieces // dp
    for step in range(STEPS):
        total = 0.0
        slices = list(zip(*(x.chunk(pieces) for x in case.make_batch(step, GB))))
        replica_grads = []
        for d in range(dp):
            opt.zero_grad(set_to_none=True)
            for mb in slices[d * per:(d + 1) * per]:
                loss = wrapped(*mb)
                (loss / per).backward()
                total += loss.item() / pieces
            replica_grads.append([p.grad.clone() for p in params])
        for i, p in enumerate(params):
            g = replica_grads[0][i].clone()
            for r in replica_grads[1:]:
                g += r[i]
            p.grad = g / dp if dp > 1 else g
        for names in tied:
            copies = [case.model.get_parameter(n) for n in names]
            grad = copies[0].grad.clone()
            for p in copies[1:]:
                grad += p.grad
            for p in copies:
                p.grad = grad.clone()
        opt.step()
        out.losses.append(total)
    out.params = {k: v.detach().clone() for k, v in case.model.state_dict().items()}
    return out


def _plan(graph: ModelGraph, pp: int, kind: str, m: int, dp: int = 1) -> Plan:
    v = 2 if kind in ("interleaved", "v") else 1
    return Plan(mesh=Mesh(pp=pp, dp=dp), schedule=Schedule(kind=kind, microbatches=m, virtual_stages=v),
                stages=even_stages(graph, pp * v), data_parallel=DataParallel(kind="ddp"))


class _StageOptimizers:
    """One DataParallelOptimizer per local stage (sharded kinds step shards, not parameters)."""

    def __init__(self, modules: dict[int, nn.Module]) -> None:
        from fairscale.runtime.optim import DataParallelOptimizer

        self.opts = [DataParallelOptimizer(gm, torch.optim.Adam, lr=1e-2) for gm in modules.values()]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.opts:
            o.step()


def _train(graph: ModelGraph, plan: Plan, batch_of: Callable[[int], tuple[torch.Tensor, ...]],
           modules: Callable[[Any], dict[int, nn.Module]] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    program = split_stages_pass(graph.gm, plan, graph=graph)
    pipe = PipelineExecutor(program, schedule_for(plan), modules=modules(program) if modules else None)
    opt: Any = _StageOptimizers(pipe.modules) if modules else make_optimizer(pipe.parameters())
    evaluated = pipe.eval_step(batch_of(0))   # forward only: the step-0 loss, and no gradients
    assert all(p.grad is None for p in pipe.parameters()), "eval_step left gradients"
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        losses.append(pipe.step(batch_of(step)))
        opt.step()
    # numpy, not tensors: torch would pass tensors to the parent as shared memory of an exited process
    assert abs(evaluated - losses[0]) <= 1e-6 * abs(losses[0]), (evaluated, losses[0])
    return losses, {k: v.numpy().copy() for k, v in pipe.state_dict().items()}


def _pp_rank(rank: int, world: int, cases: list[tuple[str, str, int]],
             graphs: dict[tuple[str, int], ModelGraph]) -> list[Any]:
    mesh, _ = build_mesh(world, 1, 1)
    with mesh.groups.active():
        out = []
        for name, kind, m in cases:
            case = MODELS[name]()
            graph = graphs[(name, GB // m)]
            plan = Plan.from_json(EDITED_PLAN) if kind == "edited" else _plan(graph, world, kind, m)
            out.append(_train(graph, plan, lambda step: case.make_batch(step, GB)))
        return out


EDITED_PLAN = """{
  "version": 1,
  "mesh": {"pp": 2, "dp": 1, "tp": 1},
  "schedule": {"kind": "1f1b", "microbatches": 4, "virtual_stages": 1},
  "stages": [{"layers": "wte, wpe"}, {"layers": "layers.*, ln_f, lm_head"}]
}"""
"""A plan a person edited by hand: the cut moved to right after the embeddings."""


def _pp_dp_rank(rank: int, world: int, cases: list[tuple[str, str]],
                graphs: dict[tuple[str, int], ModelGraph]) -> list[Any]:
    from passes.dp.shard_data_parallel import shard_data_parallel_pass

    mesh, _ = build_mesh(2, 2, 1)
    with mesh.groups.active():
        out = []
        for name, dp_kind in cases:
            case = MODELS[name]()
            graph = graphs[(name, GB // 4)]
            plan = _plan(graph, 2, "1f1b", 2, dp=2)
            plan.data_parallel = DataParallel(kind=dp_kind, units="layers.*")
            half = GB // 2

            def batch_of(step: int) -> tuple[torch.Tensor, ...]:
                return tuple(x[mesh.dp_index * half:(mesh.dp_index + 1) * half] for x in case.make_batch(step, GB))

            def modules(program: Any) -> dict[int, nn.Module]:
                # tied copies (gpt) stay whole inside sharded kinds, so the pipeline can sum their grads
                return {s: shard_data_parallel_pass(st.gm, plan, dp_index=mesh.dp_index, dp_size=2,
                                                    replicate=program.shared_keys(s))
                        for s, st in enumerate(program.stages) if s % 2 == mesh.pp_index}

            out.append(_train(graph, plan, batch_of, modules))  # the loss is averaged over dp by the executor
        return out


CASES = {pp: [(name, kind, m) for name in MODELS for kind in KINDS for m in (pp, 2 * pp)] for pp in (2, 4)}
CASES[2].append(("gpt", "edited", 4))
DP_CASES = [(name, "ddp") for name in MODELS] + [("llama", "fsdp"), ("gpt", "zero2"), ("skip", "zero1")]


@pytest.fixture(scope="module")
def prepared() -> dict[str, Any]:
    """Captures for every microbatch size, and the references, made once before any fork."""
    sizes = {GB // m for pp in (2, 4) for m in (pp, 2 * pp)}
    graphs = {}
    for name, make in MODELS.items():
        for mb in sizes:
            case = make()
            graphs[(name, mb)] = capture(case.model, case.make_batch(0, mb), loss_fn=case.loss_fn, annotate=False)
    refs = {(name, GB // mb): accumulated_reference(make, GB // mb) for name, make in MODELS.items() for mb in sizes}
    refs.update({(name, 1): train_reference(make, steps=STEPS, global_batch=GB) for name, make in MODELS.items()})
    refs.update({(name, "dp2"): accumulated_reference(make, 4, dp=2) for name, make in MODELS.items()})
    return {"graphs": graphs, "refs": refs}


@pytest.fixture(scope="module")
def runs(prepared: dict[str, Any]) -> dict[str, Any]:
    """Every pp-only configuration: one launch per world size."""
    results = {}
    for pp in (2, 4):
        per_rank = rt.launch(_pp_rank, pp, args=(CASES[pp], prepared["graphs"]))
        for i, case in enumerate(CASES[pp]):
            results[(pp, *case)] = _merge([r[i] for r in per_rank])
    return {"refs": prepared["refs"], "results": results}


@pytest.fixture(scope="module")
def dp_runs(prepared: dict[str, Any]) -> dict[str, Any]:
    """pp × dp = 2 × 2 with the data-parallel pass, in one launch (separate, so that a data-parallel
    failure does not hide the pipeline-only results)."""
    per_rank = rt.launch(_pp_dp_rank, 4, args=(DP_CASES, prepared["graphs"]))
    results = {}
    for i, (name, dp_kind) in enumerate(DP_CASES):
        results[("ppdp", name, dp_kind)] = _merge([per_rank[0][i], per_rank[2][i]])  # dp index 0 of each stage
        for r in (1, 3):  # the other dp replica holds identical parameters
            for k, v in per_rank[r][i][1].items():
                assert (v == per_rank[r - 1][i][1][k]).all(), f"dp replicas differ on {k}"
    return {"refs": prepared["refs"], "results": results}


def _merge(parts: list[tuple[list[float], dict[str, Any]]]) -> Trajectory:
    got = Trajectory(losses=parts[0][0])
    for losses, arrays in parts:
        assert losses == got.losses, "pp ranks report different losses"
        for k, a in arrays.items():
            v = torch.from_numpy(a)
            if k in got.params:  # a tied copy on two stages: the copies must stay identical
                assert torch.equal(got.params[k], v), f"tied copies of {k} differ"
            got.params[k] = v
    return got


def _check(runs: dict[str, Any], name: str, pieces: int | str, got: Trajectory) -> None:
    compare(runs["refs"][(name, pieces)], got)
    full = runs["refs"][(name, 1)]
    compare(Trajectory(losses=full.losses), Trajectory(losses=got.losses))


@pytest.mark.parametrize("pp,name,kind,m", [(pp, *c) for pp in (2, 4) for c in CASES[pp] if c[1] in KINDS])
def test_pipeline_matches_single_process(runs: dict[str, Any], pp: int, name: str, kind: str, m: int) -> None:
    _check(runs, name, m, runs["results"][(pp, name, kind, m)])


def test_hand_edited_plan_moves_the_cut(runs: dict[str, Any]) -> None:
    _check(runs, "gpt", 4, runs["results"][(2, "gpt", "edited", 4)])


@pytest.mark.parametrize("name,dp_kind", DP_CASES)
def test_pipeline_times_data_parallel(dp_runs: dict[str, Any], name: str, dp_kind: str) -> None:
    _check(dp_runs, name, "dp2", dp_runs["results"][("ppdp", name, dp_kind)])


def test_tied_embedding_copies_are_summed_and_identical(runs: dict[str, Any]) -> None:
    got = runs["results"][(4, "gpt", "interleaved", 8)]
    assert torch.equal(got.params["wte.weight"], got.params["lm_head.weight"])
    ref = runs["refs"][("gpt", 8)]
    assert (got.params["wte.weight"] - ref.params["wte.weight"]).abs().max() < 1e-5


def _mismatch_rank(rank: int, world: int, graphs: dict[int, ModelGraph]) -> None:
    mesh, _ = build_mesh(world, 1, 1)
    with mesh.groups.active():
        graph = graphs[rank]  # rank 1 split a capture made for another microbatch size
        m = 4 if rank == 0 else 2
        case = MODELS["gpt"]()
        _train(graph, _plan(graph, 2, "1f1b", m), lambda step: case.make_batch(step, GB))


def test_shape_mismatch_between_stages_is_an_error_on_both_sides() -> None:
    case = MODELS["gpt"]()
    graphs = {r: capture(case.model, case.make_batch(0, mb), loss_fn=case.loss_fn, annotate=False)
              for r, mb in ((0, 2), (1, 4))}
    with pytest.raises(rt.RankFailedError) as info:
        rt.launch(_mismatch_rank, 2, args=(graphs,), grace_s=20)
    text = re.escape("pipeline shape handshake failed: stage 0 sends [[2, 32, 64]:float32] but stage 1 "
                     "expects [[4, 32, 64]:float32]")
    assert set(info.value.failures) == {0, 1}
    for tb in info.value.failures.values():
        assert re.search(text, tb), tb


def test_wrong_microbatch_shape_is_a_clear_error() -> None:
    case = MODELS["skip"]()
    graph = capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn, annotate=False)
    plan = _plan(graph, 1, "interleaved", 4)
    program = split_stages_pass(graph.gm, plan, graph=graph)
    pipe = PipelineExecutor(program, build_schedule("interleaved", pp=1, microbatches=4, virtual_stages=2))
    with pytest.raises(PipelineError, match=re.escape("microbatch input 0 has shape [4, 8] but stage 0 was "
                                                      "captured for [2, 8]")):
        pipe.step(case.make_batch(0, 16))
    with pytest.raises(PipelineError, match="batch input 0 has 6 rows, which do not split into 4 microbatches"):
        pipe.step(case.make_batch(0, 6))
    with pytest.raises(PipelineError, match="the schedule has 4 stages but the program has 2"):
        PipelineExecutor(program, build_schedule("interleaved", pp=1, microbatches=4, virtual_stages=4))


def test_tied_weights_across_stages_with_sharded_dp_are_refused() -> None:
    from passes.dp.shard_data_parallel import shard_data_parallel_pass

    case = MODELS["gpt"]()
    graph = capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn, annotate=False)
    plan = _plan(graph, 1, "interleaved", 4)
    plan.data_parallel = DataParallel(kind="zero2")
    program = split_stages_pass(graph.gm, plan, graph=graph)
    modules = {s: shard_data_parallel_pass(st.gm, plan, dp_index=0, dp_size=1) for s, st in enumerate(program.stages)}
    with pytest.raises(PipelineError, match=re.escape(
            "wte.weight is used by stages [0, 1] (tied weights), and stage 0 shards it with data-parallel kind "
            "'zero2'") + ".*" + re.escape("shard_data_parallel_pass(..., replicate=['wte.weight'])")):
        PipelineExecutor(program, schedule_for(plan), modules=modules)
    # kept whole (all-reduced) inside zero2, the tied copies can be summed
    assert [program.shared_keys(s) for s in range(2)] == [["wte.weight"], ["lm_head.weight"]]
    modules = {s: shard_data_parallel_pass(st.gm, plan, dp_index=0, dp_size=1, replicate=program.shared_keys(s))
               for s, st in enumerate(program.stages)}
    PipelineExecutor(program, schedule_for(plan), modules=modules)


def _no_param_stage_rank(rank: int, world: int) -> list[float]:
    import functools

    import fairscale
    from planner.plan import Mesh, Plan, Schedule, Stage

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3])
    plan = Plan(mesh=Mesh(pp=2), schedule=Schedule(kind="1f1b", microbatches=2), stages=[Stage(layers="0"),
                                                                                          Stage(layers="1")])
    pm = fairscale.parallelize(model, example_inputs=(x, y), loss_fn=torch.nn.functional.cross_entropy, plan=plan,
                               optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    return [pm.train_step((x, y)) for _ in range(2)]


def test_a_stage_without_parameters_trains() -> None:
    """A pipeline stage that holds only parameterless layers (an activation, Whisper's interleaved
    stage) crashed every rank after launch: torch.optim refuses an empty parameter list."""
    import fairscale

    losses = fairscale.launch(_no_param_stage_rank, devices=2)
    assert losses[0] == losses[1] and losses[0][1] < losses[0][0]
