"""Tensor and sequence parallelism on real gloo ranks: 3 Adam steps match single-process training.

One launch per (family, tp) runs both variants (with and without sequence parallelism) on graphs
captured once in the parent. The rules come from the pattern detector, so what the planner would
propose is what is checked. Llama and Mixtral at tp=4 use 8 query / 4 KV heads (GQA with KV heads
divisible by 4; the 4/2 default raises, see tests/passes/test_tensor_parallel_pass.py).

Why float64: with Adam at lr 1e-2, parameters whose true gradient is ~eps (q/k weights at init)
get an update of ±lr·g/(|g|+eps) from rounding noise alone, so the reassociated fp32 sums of a
row-parallel matmul (two half-sums added by the all-reduce) move a few of them by ~1e-5. In
float64 the same code paths are checked at the same 1e-5 tolerance with the noise far below it
(the data-parallel tests do the same, see dp_harness.py). The loss is computed in float64 too
(``lm_loss`` would cast the logits to float32). Mixtral's experts stay float32 (no float64
grouped matmul): its float64 parameters are compared as above, and every tensor's first-step
gradient and every loss within its dtype's tolerance (``compare_grads``, fairscale.numerics), the
float32 standard; so is the float32 Llama.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fairscale
from fairscale.runtime.mesh import build_mesh
from fairscale.testing.models import Case, build
from fairscale.runtime.state import full_grads
from fairscale.testing.reference import Trajectory, compare, compare_grads, make_optimizer, train_reference
from passes.ops import comm
from passes.layout import META_LAYOUT
from passes.tp.shard_tensor_parallel import collective_counts, shard_tensor_parallel_pass
from passes.tp.summary import tp_summary
from passes.tp.patterns import propose_tp_rules
from planner.capture import capture
from planner.plan import Mesh, Plan, TensorParallel

STEPS, BATCH = 3, 8
FAMILIES = ("llama", "gpt2", "bert", "mixtral")
TPS = (2, 4)


def overrides(family: str, tp: int) -> dict[str, Any]:
    return dict(heads=8, kv_heads=4) if family in ("llama", "mixtral") and tp == 4 else {}


def lm_loss64(out: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def make_case(family: str, tp: int) -> Case:
    case = build(family, **overrides(family, tp))
    case.model.to(torch.float64)
    if family == "mixtral":  # HF's MoE grouped matmul has no float64 kernel: experts stay float32
        for layer in case.model.model.layers:
            layer.mlp.experts.float()
    make = case.make_batch

    def batch(step: int, n: int) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(torch.float64) if t.is_floating_point() else t for t in make(step, n))

    loss_fn = lm_loss64 if case.loss_fn is not None and case.loss_fn.__name__ == "lm_loss" else case.loss_fn
    return dataclasses.replace(case, make_batch=batch, loss_fn=loss_fn)


def gather_state(gm: torch.fx.GraphModule, tied: list[list[str]], group: Any = None) -> dict[str, Any]:
    """The user's full state_dict from one rank's graph (collective over the tp group, default: all ranks)."""
    layout = gm.meta[META_LAYOUT]
    world = dist.get_world_size(group)
    out: dict[str, Any] = {}
    tensors = dict(gm.named_parameters(remove_duplicate=False)) | dict(gm.named_buffers(remove_duplicate=False))
    for attr, t in tensors.items():
        key = layout.keys.get(attr)
        if key is None:
            continue
        t = t.detach()
        if key in layout.tp:
            pieces = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(pieces, t.contiguous(), group=group)
            t = layout.tp[key].assemble(pieces)
        out[key] = t.numpy().copy()
    for group in tied:
        have = next((k for k in group if k in out), None)
        for k in group:
            if have is not None and k not in out:
                out[k] = out[have]
    return out


def _rank(rank: int, world: int, gm: torch.fx.GraphModule, rules: dict[str, str], family: str, tp: int,
          tied: list[list[str]]) -> dict[bool, Any]:
    mesh, _ = build_mesh(1, 1, tp)
    with mesh.groups.active():
        case = make_case(family, tp)
        results = {}
        for sp in (False, True):
            plan = Plan(mesh=Mesh(tp=tp), tensor_parallel=TensorParallel(rules=rules, sequence_parallel=sp))
            local = shard_tensor_parallel_pass(copy.deepcopy(gm), plan, tp_index=rank, tp_size=tp)
            opt = make_optimizer(local.parameters())
            losses = []
            for step in range(STEPS):
                opt.zero_grad(set_to_none=True)
                comm.COUNTER.reset()
                loss = local(*case.make_batch(step, BATCH))
                loss.backward()
                moved = comm.COUNTER.total_bytes()  # of the last step
                if step == 0:  # collective, uncounted
                    grads = {k: v.numpy() for k, v in full_grads(local, aliases=tied).items()}
                opt.step()
                losses.append(loss.item())
            state = gather_state(local, tied)  # collective: every rank takes part
            results[sp] = (losses, state if rank == 0 else None, collective_counts(local), moved, grads)
        return results


_RUNS: dict[tuple[str, int], Any] = {}


def run(family: str, tp: int) -> tuple[Trajectory, list[dict[bool, Any]], dict[str, str]]:
    if (family, tp) not in _RUNS:
        case = make_case(family, tp)
        graph = capture(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn)
        rules = propose_tp_rules(graph.gm, tp=tp).rules
        ref = train_reference(lambda: make_case(family, tp), steps=STEPS, global_batch=BATCH)
        results = fairscale.launch(_rank, devices=tp, args=(graph.gm, rules, family, tp, graph.tied))
        _RUNS[(family, tp)] = (ref, results, rules)
    return _RUNS[(family, tp)]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_single_process(family: str, tp: int, sp: bool) -> None:
    ref, results, rules = run(family, tp)
    losses, state, counts, _, grads = results[0][sp]
    for other in results[1:]:
        assert other[sp][0] == losses, "tp ranks disagree on the loss"
    got = Trajectory(losses=losses, params={k: torch.from_numpy(v) for k, v in state.items()},
                     grads={k: torch.from_numpy(v) for k, v in grads.items()})
    compare(ref, got, dtypes=(torch.float64,))  # Mixtral's float32 experts: by gradients, below
    compare_grads(ref, got)
    # the run really was tensor parallel: the vocab and the blocks were sharded
    assert counts.get("vocab_parallel_cross_entropy") == 1 and counts.get("vocab_parallel_embedding") == 1
    if sp:
        assert counts.get("gather_seq", 0) > 0 and counts.get("reduce_scatter_seq", 0) > 0
        assert "reduce_from_group" not in counts
    else:
        assert counts.get("reduce_from_group", 0) > 0 and "gather_seq" not in counts
    styles = set(rules.values())
    assert {"colwise", "vocab_embedding", "vocab_loss"} <= styles
    assert ("expert" in styles) == (family == "mixtral")


BLOCK_RULES = {"layers.*.self_attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.self_attn.o_proj": "rowwise",
               "layers.*.mlp.[gate_proj,up_proj]": "colwise", "layers.*.mlp.down_proj": "rowwise"}


def test_replicated_embedding_under_sequence_parallelism() -> None:
    """Blocks only (embedding and LM head replicated, as in benchmarks/tensor_parallel): under SP the
    embedding output enters the residual by local_chunk and layer 0's norm runs backward on partial
    sums (passes.tp.fuse.hoist_copy_over_scatter); training still matches single-process."""
    case = make_case("llama", 2)
    graph = capture(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn)
    ref = train_reference(lambda: make_case("llama", 2), steps=STEPS, global_batch=BATCH)
    results = fairscale.launch(_rank, devices=2, args=(graph.gm, BLOCK_RULES, "llama", 2, graph.tied))
    b, t, d, layers = BATCH, 16, 64, 2  # build("llama") defaults; float64
    act, ring = b * t * d * 8, (2 - 1) / 2  # bytes of one [b, t, d] activation; (n-1)/n on 2 ranks
    theory = {  # Megatron: 4 all-reduces of [b, t, d] per layer (2 forward, 2 backward)
        False: layers * 4 * 2 * ring * act,
        # SP: the same volume as all-gather/reduce-scatter pairs, the final hidden state gathered for
        # the replicated LM head, and the gradient of every norm weight all-reduced (2 per layer + final)
        True: layers * 4 * 2 * ring * act + ring * act + (2 * layers + 1) * 2 * ring * d * 8}
    for sp in (False, True):
        losses, state, counts, moved, _ = results[0][sp]
        assert results[1][sp][0] == losses
        compare(ref, Trajectory(losses=losses, params={k: torch.from_numpy(v) for k, v in state.items()}))
        assert counts.get("local_chunk", 0) == (1 if sp else 0)
        assert all(r[sp][3] == theory[sp] for r in results), (sp, [r[sp][3] for r in results], theory[sp])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "t5", "vit", "encoder", "mlp"])
def test_other_families_match_single_process(family: str) -> None:
    """Whatever the detector proposes for the other zoo families is exact too (tp=2, both variants)."""
    ref, results, rules = run(family, 2)
    assert rules
    for sp in (False, True):
        losses, state, _, _, _ = results[0][sp]
        compare(ref, Trajectory(losses=losses, params={k: torch.from_numpy(v) for k, v in state.items()}))


# ------------------------------------------------------------------------------------------ composition


def _staged_rank(rank: int, world: int, program: Any, rules: dict[str, str], tied: list[list[str]]) -> dict[bool, Any]:
    """Both pipeline stages of Llama on every tp rank, run back to back (the pipeline runtime sends
    the boundary tensors instead); TP is applied to each stage graph separately."""
    mesh, _ = build_mesh(1, 1, world)
    with mesh.groups.active():
        case = make_case("llama", world)
        out = {}
        for sp in (False, True):
            plan = Plan(mesh=Mesh(tp=world), tensor_parallel=TensorParallel(rules=rules, sequence_parallel=sp))
            stages = [shard_tensor_parallel_pass(copy.deepcopy(st.gm), plan, tp_index=rank, tp_size=world)
                      for st in program.stages]
            opt = make_optimizer([p for st in stages for p in st.parameters()])
            losses = []
            for step in range(STEPS):
                batch = case.make_batch(step, BATCH)
                opt.zero_grad(set_to_none=True)
                sent = stages[0](*[batch[i] for i in program.stages[0].batch_inputs])
                recv = [t.detach().requires_grad_(t.is_floating_point()) for t in sent]
                (loss,) = stages[1](*[batch[i] for i in program.stages[1].batch_inputs], *recv)
                loss.backward()
                torch.autograd.backward([t for t, r in zip(sent, recv) if r.grad is not None],
                                        [r.grad for r in recv if r.grad is not None])
                opt.step()
                losses.append(loss.item())
            state: dict[str, Any] = {}
            for st in stages:
                state.update(gather_state(st, tied))
            out[sp] = (losses, state if rank == 0 else None,
                       [collective_counts(st) for st in stages])
        return out


def test_tensor_parallel_on_pipeline_stage_graphs() -> None:
    from passes.split_stages import split_stages_pass
    from planner.plan import Stage

    case = make_case("llama", 2)
    graph = capture(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn)
    plan = Plan(mesh=Mesh(pp=2), stages=[Stage(layers="embed_tokens, layers.0"),
                                         Stage(layers="layers.1, norm, lm_head")])
    program = split_stages_pass(graph.gm, plan, graph=graph)
    rules = propose_tp_rules(graph.gm, tp=2).rules
    ref = train_reference(lambda: make_case("llama", 2), steps=STEPS, global_batch=BATCH)
    results = fairscale.launch(_staged_rank, devices=2, args=(program, rules, graph.tied))
    for sp in (False, True):
        losses, state, counts = results[0][sp]
        compare(ref, Trajectory(losses=losses, params={k: torch.from_numpy(v) for k, v in state.items()}))
        # stage 0 holds the vocab embedding and one block, stage 1 one block and the vocab-parallel loss
        assert counts[0]["vocab_parallel_embedding"] == 1 and "vocab_parallel_cross_entropy" not in counts[0]
        assert counts[1]["vocab_parallel_cross_entropy"] == 1
        if sp:  # the boundary activation crosses as its sequence shard: no gather before the cut, no
            # split after it; the two stages together call exactly the collectives of the unsplit graph
            sp_plan = Plan(mesh=Mesh(tp=2), tensor_parallel=TensorParallel(rules=rules, sequence_parallel=True))
            whole = collective_counts(shard_tensor_parallel_pass(graph.gm, sp_plan, tp_index=0, tp_size=2))
            assert Counter(counts[0]) + Counter(counts[1]) == Counter(whole)
            for c in counts:
                assert not {"gather_from_group", "scatter_to_group", "local_chunk"} & set(c)


MICRO = 2


def _pipeline_rank(rank: int, world: int, program: Any, rules: dict[str, str],
                   tied: list[list[str]]) -> tuple[Any, ...]:
    """pp=2 × tp=2 with sequence parallelism through the pipeline runtime (1F1B, 2 microbatches)."""
    from fairscale.runtime.pipeline import PipelineExecutor
    from planner.schedule import build_schedule

    mesh, _ = build_mesh(2, 1, 2)
    with mesh.groups.active():
        pp_index, tp_index = comm.group_rank("pp"), comm.group_rank("tp")
        case = make_case("llama", 2)
        plan = Plan(mesh=Mesh(tp=2), tensor_parallel=TensorParallel(rules=rules, sequence_parallel=True))
        stage = shard_tensor_parallel_pass(program.stages[pp_index].gm, plan, tp_index=tp_index, tp_size=2)
        pipe = PipelineExecutor(program, build_schedule("1f1b", pp=2, microbatches=MICRO), modules={pp_index: stage})
        opt = make_optimizer(pipe.parameters())
        losses, sent = [], []
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            comm.COUNTER.reset()
            losses.append(pipe.step(case.make_batch(step, BATCH)))
            sent.append(comm.COUNTER.snapshot().get("send:pp", {}).get("bytes", 0.0))
            opt.step()
        state = gather_state(stage, tied, group=comm.get_group("tp"))
        return pp_index, tp_index, losses, state if tp_index == 0 else None, sent, tp_summary(stage)


def test_pipeline_sends_sequence_shards_under_sequence_parallelism() -> None:
    """pp × tp × SP on 4 gloo ranks through PipelineExecutor: the boundary activation travels as
    its sequence shard (Megatron-LM's p2p of the SP shard), so each rank sends 1/tp of the
    activation per microbatch (forward on stage 0, its gradient back on stage 1), and training
    matches single-process."""
    from passes.split_stages import split_stages_pass
    from planner.plan import Stage

    case = make_case("llama", 2)
    graph = capture(case.model, case.make_batch(0, BATCH // MICRO), loss_fn=case.loss_fn)
    plan = Plan(mesh=Mesh(pp=2), stages=[Stage(layers="embed_tokens, layers.0"),
                                         Stage(layers="layers.1, norm, lm_head")])
    program = split_stages_pass(graph.gm, plan, graph=graph)
    (boundary,) = program.stages[0].outputs
    b, t, d = boundary.shape
    rules = propose_tp_rules(graph.gm, tp=2).rules
    ref = train_reference(lambda: make_case("llama", 2), steps=STEPS, global_batch=BATCH)
    results = fairscale.launch(_pipeline_rank, devices=4, args=(program, rules, graph.tied))
    shard = (b, t // 2, d)
    state: dict[str, Any] = {}
    for pp_index, tp_index, losses, part, sent, summary in results:
        assert losses == results[0][2]
        # every rank sends MICRO shards a step: activations forward from stage 0, gradients back from stage 1
        assert sent == [MICRO * b * (t // 2) * d * 8.0] * STEPS
        if pp_index == 0:
            assert summary["sent"] == [("S(1)", shard)] and summary["received"] == []
        else:
            assert summary["received"] == [("S(1)", shard)] and summary["sent"] == []
        state.update(part or {})
    compare(ref, Trajectory(losses=results[0][2], params={k: torch.from_numpy(v) for k, v in state.items()}))


def _fp32_rank(rank: int, world: int, gm: torch.fx.GraphModule, rules: dict[str, str],
               tied: list[list[str]]) -> dict[bool, Any]:
    mesh, _ = build_mesh(1, 1, world)
    with mesh.groups.active():
        case = build("llama")
        out = {}
        for sp in (False, True):
            plan = Plan(mesh=Mesh(tp=world), tensor_parallel=TensorParallel(rules=rules, sequence_parallel=sp))
            local = shard_tensor_parallel_pass(copy.deepcopy(gm), plan, tp_index=rank, tp_size=world)
            opt = make_optimizer(local.parameters())
            losses = []
            for step in range(STEPS):
                opt.zero_grad(set_to_none=True)
                loss = local(*case.make_batch(step, BATCH))
                loss.backward()
                if step == 0:
                    grads = {k: v.numpy() for k, v in full_grads(local, aliases=tied).items()}
                opt.step()
                losses.append(loss.item())
            out[sp] = (losses, gather_state(local, tied), grads)
        return out


def test_float32_llama() -> None:
    """The default dtype end to end: the losses of 3 Adam steps and the first step's gradients
    within float32 tolerance (compare_grads; parameters after Adam are no float32 measure, see
    the module docstring; float64 runs check them at 1e-5)."""
    case = build("llama")
    graph = capture(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn)
    rules = propose_tp_rules(graph.gm, tp=2).rules
    ref = train_reference(lambda: build("llama"), steps=STEPS, global_batch=BATCH)
    results = fairscale.launch(_fp32_rank, devices=2, args=(graph.gm, rules, graph.tied))
    for sp in (False, True):
        losses, state, grads = results[0][sp]
        compare_grads(ref, Trajectory(losses=losses, params={k: torch.from_numpy(v) for k, v in state.items()},
                                      grads={k: torch.from_numpy(v) for k, v in grads.items()}))


def _engine_rank(rank: int, world: int, plan: Plan) -> tuple[list[float], dict[str, Any]]:
    import functools

    from fairscale.build import build_module

    case = make_case("gpt2", 2)
    pm = build_module(case.model, plan, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                      optimizer=functools.partial(torch.optim.Adam, lr=1e-2))
    losses = [pm.train_step(case.make_batch(step, BATCH)) for step in range(STEPS)]
    return losses, {k: v.detach().numpy() for k, v in pm.state_dict().items()}


def test_tensor_and_sequence_parallel_under_fsdp() -> None:
    """dp=2 × tp=2 through the engine (split → TP → recompute → FSDP): GPT-2 with sequence
    parallelism and FSDP resharding after forward, where replicated biases meet freed unit storage."""
    from planner.plan import DataParallel

    case = make_case("gpt2", 2)
    graph = capture(case.model, case.make_batch(0, BATCH // 2), loss_fn=case.loss_fn)
    rules = propose_tp_rules(graph.gm, tp=2).rules
    plan = Plan(mesh=Mesh(dp=2, tp=2), tensor_parallel=TensorParallel(rules=rules, sequence_parallel=True),
                data_parallel=DataParallel(kind="fsdp", units="h.*", reshard_after_forward=True))
    ref = train_reference(lambda: make_case("gpt2", 2), steps=STEPS, global_batch=BATCH)
    losses, state = fairscale.launch(_engine_rank, devices=4, args=(plan,))[0]
    compare(ref, Trajectory(losses=losses, params={k: torch.from_numpy(v) for k, v in state.items()}))
