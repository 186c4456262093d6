"""One copy of the weights, and memory measured against the plan (issue 18 item 4, issue 16 item 3).

On 2 real gloo ranks, ``parallelize`` a GPT under DDP, ZeRO-2 and FSDP (dp = 2), a two-stage
pipeline (pp = 2), Megatron's tensor parallelism (tp = 2: whole and split saved tensors, from the
capture) and that pipeline with full recompute of every block (the kept inputs plus the one block
a recompute rebuilds in backward, which the meter sees through ``RECOMPUTE_LISTENERS``), and tp = 2
with selective recompute (the cached matmul outputs, which the meter sees through
``RETAIN_LISTENERS``: row-parallel outputs are full-size partial sums, the rest split), run one
step with ``measure_memory=True`` and read ``pm.memory_report()``: every category the planner
predicts (parameters, gradients, optimizer state, saved activations, FSDP buffers) is measured
within 10% of its prediction.

The report is the runtime's own accounting; an independent count keeps it honest: every tensor
storage that ``parallelize`` and the step left alive in the rank process (``gc``, against a count
taken before), less the user's model and the batch, adds up to the parameters, gradients and
optimizer state the report lists. Before the runtime freed the stage
graphs' copies (``passes.compile_rank`` releases them) that count was one whole model larger: DDP
held 5× the model's bytes per rank instead of 4× (P + G + Adam's 2), ZeRO-2 4× instead of 3×,
FSDP at dp = 2 3× instead of 2×.
"""

from __future__ import annotations

import functools
import gc
import weakref
from typing import Any

import pytest
import torch

import fairscale
from fairscale.testing.models import build
from passes import compile_rank
from planner.capture import capture
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage, TensorParallel
from fairscale.testing.reference import start_again

MiB = 2**20
TP_RULES = {"layers.*.attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.attn.o_proj": "rowwise",
            "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise", "lm_head": "vocab_loss",
            "wte": "vocab_embedding"}
PLANS: dict[str, Plan] = {
    "ddp": Plan(mesh=Mesh(dp=2), data_parallel=DataParallel(kind="ddp")),
    "zero2": Plan(mesh=Mesh(dp=2), data_parallel=DataParallel(kind="zero2")),
    "fsdp": Plan(mesh=Mesh(dp=2), data_parallel=DataParallel(kind="fsdp", units="layers.*")),
    "pp2": Plan(mesh=Mesh(pp=2), schedule=Schedule(kind="1f1b", microbatches=2),
                stages=[Stage(layers="wte, wpe, layers.[0-1]"), Stage(layers="layers.[2-3], ln_f, lm_head")]),
    "tp2": Plan(mesh=Mesh(tp=2), tensor_parallel=TensorParallel(rules=TP_RULES)),
    "pp2 recompute": Plan(mesh=Mesh(pp=2), schedule=Schedule(kind="1f1b", microbatches=4),
                          stages=[Stage(layers="wte, wpe, layers.[0-1]"), Stage(layers="layers.[2-3], ln_f, lm_head")],
                          recompute={"layers.*": "full"}),
    "tp2 selective": Plan(mesh=Mesh(tp=2), tensor_parallel=TensorParallel(rules=TP_RULES),
                          recompute={"layers.*": "selective"}),
}
MODEL_STATES = ("parameters", "gradients", "optimizer")


def _case() -> Any:
    return build("gpt", layers=4, dim=128)


def _real_tensors() -> list[torch.Tensor]:
    return [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and not obj.is_meta
            and (type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter))]  # fake tensors hold no memory


def _new_bytes(before: dict[int, weakref.ref], exclude: set[int]) -> int:  # type: ignore[type-arg]
    """Bytes of the tensor storages alive now that no tensor alive before held (nor ``exclude``).
    Tensors are told apart by identity (a weak reference to the same object), not by address: the forked rank
    inherits the test process's tensors, some of which are freed meanwhile and their memory reused."""
    alive = [t for t in (r() for r in before.values()) if t is not None]
    old = {t.untyped_storage().data_ptr() for t in alive}
    seen: dict[int, int] = {}
    for t in _real_tensors():
        known = before.get(id(t))
        if known is not None and known() is t:
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr and ptr not in exclude and ptr not in old:
            seen[ptr] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _rank(rank: int, world: int) -> dict[str, Any]:
    out = {}
    case = _case()  # one model for every plan, as a user re-planning it would (its captures are cached)
    batch = case.make_batch(0, 8)
    mine = {t.untyped_storage().data_ptr() for t in [*case.model.parameters(), *case.model.buffers(), *batch]}
    for name, plan in PLANS.items():
        gc.collect()
        before = {id(t): weakref.ref(t) for t in _real_tensors()}  # what the process held already (inherited from the test process)
        start_again(case.model)  # each plan from the model's initial weights
        pm = fairscale.parallelize(case.model, example_inputs=batch, loss_fn=case.loss_fn, plan=plan)
        pm.train_step(batch, measure_memory=True)
        report = pm.memory_report()
        gc.collect()
        out[name] = dict(predicted=report.predicted, measured=report.measured, table=report.table(),
                         live=_new_bytes(before, mine),
                         model=sum(p.numel() * p.element_size() for p in case.model.parameters()))
        del pm  # collected at the next plan's count
    return out


@functools.lru_cache(maxsize=None)
def _results() -> list[dict[str, Any]]:
    return fairscale.launch(_rank, devices=2)


@pytest.mark.parametrize("name", list(PLANS))
def test_every_category_is_measured_within_ten_percent_of_the_plan(name: str) -> None:
    for rank, got in enumerate(_results()):
        r = got[name]
        for cat, predicted in r["predicted"].items():
            measured = r["measured"][cat]
            assert measured is not None, f"rank {rank}, {cat}: not measured\n{r['table']}"
            assert measured == pytest.approx(predicted, rel=0.10, abs=4096), f"rank {rank}, {name}, {cat}\n{r['table']}"
        assert "parameters" in r["table"] and "predicted MiB" in r["table"]


@pytest.mark.parametrize("name", ["tp2", "pp2 recompute"])
def test_activations_under_tp_and_recompute_are_predicted_within_two_percent(name: str) -> None:
    """Tighter than the 10% above, where the count is exact: under tp each saved tensor of the
    capture is whole or split (Korthikanti's 5 whole inputs per block over-predicted by 5% here).
    Under full recompute the last stage's peak is its last block's rebuild after the head's
    backward freed the head's activations, the block's kept input counted once (all kept bytes
    plus the whole block's activations over-predicted it by 29%, and the meter did not see the
    rebuild, which checkpointing saves through its own hooks); it was one block input higher while a
    waited send batch kept the previous microbatch's received activation alive
    (``fairscale.runtime.p2p.Batch.wait`` now drops its works). The first stage is left to the 10%
    test: its first block's input includes the position embeddings, one copy per microbatch of any
    size, which the capture's per-sample facts scale with the batch (4% under at 2 samples)."""
    for rank, got in enumerate(_results()):
        if name == "pp2 recompute" and rank == 0:
            continue
        r = got[name]
        assert r["measured"]["activations"] == pytest.approx(r["predicted"]["activations"], rel=0.02), \
            f"rank {rank}, {name}\n{r['table']}"


@pytest.mark.parametrize("name", list(PLANS))
def test_the_rank_holds_one_copy_of_its_weights(name: str) -> None:
    """Every tensor alive in the rank, less the user's model and batch, is a model state the report
    counts: no stage-graph copies, no capture kept alive."""
    for got in _results():
        r = got[name]
        held = sum(r["measured"][c] for c in MODEL_STATES)
        assert r["live"] == pytest.approx(held, rel=0.01, abs=64 * 1024), r["table"]
    if name == "ddp":  # P + G + Adam's two moments, each the whole model
        assert _results()[0][name]["live"] == pytest.approx(4 * _results()[0][name]["model"], rel=0.01)
    if name == "fsdp":  # the same, halved over dp = 2
        assert _results()[0][name]["live"] == pytest.approx(2 * _results()[0][name]["model"], rel=0.01)


def test_compile_rank_keeps_no_reference_to_the_capture() -> None:
    """The split stage graphs are released: a rank keeps its compiled stage, other stages keep only
    their boundary specs, and no compiled parameter shares storage with the captured model."""
    case = _case()
    graph = capture(case.model, case.make_batch(0, 4), loss_fn=case.loss_fn, annotate=False)
    program, modules = compile_rank(graph, PLANS["pp2"], stages=[0], dp_index=0, tp_index=0)
    assert program.stages[0].gm is modules[0] and program.stages[1].gm is None
    assert program.stages[1].param_keys() and program.stages[1].inputs  # specs stay for the runtime
    captured = {p.untyped_storage().data_ptr() for p in graph.gm.parameters()}
    assert not [n for n, p in modules[0].named_parameters() if p.untyped_storage().data_ptr() in captured]
