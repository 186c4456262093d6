"""validate_plan on real captured graphs: every problem is reported at once, asserted by its text."""

from __future__ import annotations

import copy
import json
import dataclasses
import re
from typing import Callable

import pytest

from fairscale.testing.models import build
from planner.capture import capture
from planner.graph import ModelGraph
from planner.plan import DataParallel, Mesh, ModelRef, Plan, PlanError, Schedule, Stage, TensorParallel, read_plan_dict
from planner.selectors import format_layers
from planner.validate import device_count, validate_plan

ATTENTION = {"heads": 4, "kv_heads": 2, "head_dim": 16}


def _capture(name: str, **kw: int) -> ModelGraph:
    case = build(name, **kw)
    return capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn)


@pytest.fixture(scope="module")
def llama() -> ModelGraph:
    """Llama with 4 decoder layers (heads 4, kv_heads 2, hidden 64, kv width 32, MLP 128)."""
    graph = _capture("llama", layers=4)
    # Attention facts as capture records them; filled here if this capture does not record them yet.
    layers = [dataclasses.replace(l, attention=l.attention or (ATTENTION if l.name.startswith("model.layers.") else None))
              for l in graph.layers]
    return dataclasses.replace(graph, layers=layers)


@pytest.fixture(scope="module")
def gpt2() -> ModelGraph:
    """GPT-2 with 2 blocks (heads 4, hidden 64); its Conv1D weights are (in, out)."""
    graph = _capture("gpt2")
    heads = {"heads": 4, "kv_heads": 4, "head_dim": 16}
    layers = [dataclasses.replace(l, attention=l.attention or (heads if l.name.startswith("transformer.h.") else None))
              for l in graph.layers]
    return dataclasses.replace(graph, layers=layers)


@pytest.fixture(scope="module")
def mixtral() -> ModelGraph:
    return _capture("mixtral")


def names(graph: ModelGraph) -> list[str]:
    return [layer.name for layer in graph.layers]


def halves(graph: ModelGraph) -> tuple[str, str]:
    """Stage selectors cutting the model before model.layers.2 (whatever glue layers capture makes)."""
    cut = names(graph).index("model.layers.2")
    return format_layers(names(graph)[:cut]), format_layers(names(graph)[cut:])


def good_plan(graph: ModelGraph) -> Plan:
    first, second = halves(graph)
    return Plan(
        model=ModelRef(class_=graph.model_class, fingerprint=graph.fingerprint, parameters=graph.num_parameters),
        mesh=Mesh(pp=2, dp=2, tp=2),
        schedule=Schedule(kind="1f1b", microbatches=4),
        stages=[Stage(layers=first), Stage(layers=second)],
        tensor_parallel=TensorParallel(rules={
            "layers.*.self_attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.[gate_proj,up_proj]": "colwise", "layers.*.mlp.down_proj": "rowwise",
            "embed_tokens": "vocab_embedding", "lm_head": "vocab_loss"}),
        data_parallel=DataParallel(kind="fsdp", units="layers.*", param_dtype="bf16"),
        recompute={"layers.[0-1]": "full", "layers.[2-3]": "selective"},
    )


def parse(text: str) -> list[str]:
    from planner.selectors import parse_selector

    return [p.text for p in parse_selector(text).patterns]


def problems(plan: Plan, graph: ModelGraph | None, devices: int | None = 8, cluster: object = None) -> list[str]:
    with pytest.raises(PlanError) as info:
        validate_plan(plan, graph, cluster, devices=devices)
    return info.value.problems


def edit(graph: ModelGraph, change: Callable[[Plan], None]) -> Plan:
    plan = good_plan(graph)
    change(plan)
    return plan


def test_the_good_plan_is_valid(llama: ModelGraph) -> None:
    validate_plan(good_plan(llama), llama, None, devices=8)


def test_mesh_product_shows_the_arithmetic(llama: ModelGraph) -> None:
    plan = edit(llama, lambda p: setattr(p.mesh, "dp", 3))
    assert problems(plan, llama) == [
        "mesh: pp(2) × dp(3) × tp(2) = 12, but 8 devices were given; choose degrees whose product is 8 "
        "(e.g. dp 2: pp(2) × dp(2) × tp(2) = 8)"]
    assert problems(plan, llama, devices=None, cluster={"nodes": 2, "gpus_per_node": 3}) == [
        "mesh: pp(2) × dp(3) × tp(2) = 12, but 6 devices are in the cluster; choose degrees whose product is 6"]


def test_device_count_sources(llama: ModelGraph) -> None:
    assert device_count(None) is None
    assert device_count(8) == 8
    assert device_count({"num_devices": 16}) == 16
    assert device_count({"nodes": 4, "gpus_per_node": 8}) == 32

    class Cluster:
        devices = [object()] * 4

    assert device_count(Cluster()) == 4
    # the plan's own cluster record is the last resort
    plan = edit(llama, lambda p: setattr(p, "cluster", {"preset": "cpu", "devices": 4}))
    assert problems(plan, llama, devices=None) == [
        "mesh: pp(2) × dp(2) × tp(2) = 8, but 4 devices are in the plan's cluster; choose degrees whose "
        "product is 4 (e.g. dp 1: pp(2) × dp(1) × tp(2) = 4)"]
    validate_plan(plan, llama, None, devices=8)  # an explicit count wins
    preset = edit(llama, lambda p: setattr(p, "cluster", {"preset": "a100-80gb", "nodes": 2}))
    # a plan may use part of its cluster (the search leaves devices idle when that is faster) ...
    validate_plan(preset, llama, None)
    # ... but a launch of 16 ranks needs a mesh of 16
    assert problems(preset, llama, devices=16) == [
        "mesh: pp(2) × dp(2) × tp(2) = 8, but 16 devices were given; choose degrees whose "
        "product is 16 (e.g. dp 4: pp(2) × dp(4) × tp(2) = 16)"]


def test_non_positive_degrees(llama: ModelGraph) -> None:
    plan = edit(llama, lambda p: setattr(p, "mesh", Mesh(pp=2, dp=0, tp=-1)))
    assert problems(plan, llama)[:2] == ["mesh.dp: expected a positive integer, got 0",
                                         "mesh.tp: expected a positive integer, got -1"]


def test_selector_that_matches_nothing_suggests_a_fix(llama: ModelGraph) -> None:
    def change(p: Plan) -> None:
        p.stages[1].layers = halves(llama)[1].replace("model.layers.[2-3]", "layerz.[2-3]")

    assert problems(edit(llama, change), llama) == [
        'stages[1].layers: "layerz.[2-3]" matches no layer; did you mean "layers.[2-3]"?',
        "stages: model.layers.[2-3] are in no stage; each layer must be in exactly one stage"]


def test_selector_without_a_close_spelling_lists_the_layers(llama: ModelGraph) -> None:
    plan = edit(llama, lambda p: setattr(p.stages[1], "layers", halves(llama)[1] + ", qqq"))
    outline = ", ".join(dict.fromkeys(re.sub(r"\.\d+", ".*", n) for n in names(llama)))
    assert outline.startswith("model.embed_tokens") and "model.layers.*, model.norm, lm_head" in outline
    assert problems(plan, llama) == [f'stages[1].layers: "qqq" matches no layer (layers are: {outline})']


def test_stage_naming_a_module_inside_a_layer(llama: ModelGraph) -> None:
    plan = edit(llama, lambda p: setattr(p.stages[1], "layers", halves(llama)[1] + ", layers.3.mlp"))
    outline = ", ".join(dict.fromkeys(re.sub(r"\.\d+", ".*", n) for n in names(llama)))
    assert problems(plan, llama) == [
        'stages[1].layers: "layers.3.mlp" matches model.layers.3.mlp, inside layer model.layers.3; a stage holds '
        f"whole layers (layers are: {outline})"]
    container = edit(llama, lambda p: setattr(p.stages[1], "layers", halves(llama)[1] + ", model.layers"))
    assert problems(container, llama) == [
        'stages[1].layers: "model.layers" matches model.layers, which holds layers model.layers.[0-3]; a stage '
        'lists layers, e.g. "model.layers.[0-3]"']


def test_stages_overlap_gap_and_order(llama: ModelGraph) -> None:
    def overlap(p: Plan) -> None:
        p.stages[1].layers = "model.layers.1, " + halves(llama)[1]

    assert problems(edit(llama, overlap), llama) == [
        "stages: model.layers.1 is in stages[0] and stages[1]; each layer must be in exactly one stage"]

    def gap(p: Plan) -> None:
        p.stages = [Stage(layers="model.embed_tokens, model.layers.0, model.layers.2"),
                    Stage(layers="model.layers.1, model.layers.3, model.norm, lm_head")]
        glue = [n for n in names(llama) if n not in parse(p.stages[0].layers + ", " + p.stages[1].layers)]
        p.stages[0].layers += "".join(f", {n}" for n in glue)  # any glue layers capture adds go first

    assert problems(edit(llama, gap), llama) == [
        "stages[0].layers: not contiguous: it holds model.embed_tokens to model.layers.2 but not model.layers.1 in "
        "between; a stage is a contiguous run of layers in execution order",
        "stages[1].layers: not contiguous: it holds model.layers.1 to lm_head but not model.layers.2 in between; "
        "a stage is a contiguous run of layers in execution order"]

    def swapped(p: Plan) -> None:
        p.stages = p.stages[::-1]

    last = len(llama.layers) - 1
    assert problems(edit(llama, swapped), llama) == [
        "stages[1]: runs before stages[0]: its first layer model.embed_tokens is layer 0, but stages[0] ends at "
        f"layer {last} (lm_head); list stages in execution order"]


def test_stage_count_must_be_pp_times_virtual_stages(llama: ModelGraph) -> None:
    def three(p: Plan) -> None:
        p.stages = [Stage(layers=halves(llama)[0].replace("model.layers.[0-1]", "model.layers.0")),
                    Stage(layers="model.layers.[1-2]"), Stage(layers="model.layers.3, model.norm, lm_head")]

    assert problems(edit(llama, three), llama) == [
        "stages: 3 stages given, but pp(2) × virtual_stages(1) = 2 are needed"]
    assert problems(edit(llama, lambda p: setattr(p, "stages", [])), llama) == [
        "stages: empty (one stage holding every layer), but pp(2) × virtual_stages(1) = 2 stages are needed"]
    empty = edit(llama, lambda p: setattr(p.stages[0], "layers", " "))
    assert problems(empty, llama) == [f'stages[0].layers: empty; write a selector, e.g. "{names(llama)[0]}"']


def test_tp_must_divide_sharded_dimensions(llama: ModelGraph) -> None:
    plan = edit(llama, lambda p: setattr(p, "mesh", Mesh(pp=2, dp=1, tp=3)))
    got = problems(plan, llama, devices=6)
    assert got == [
        'tensor_parallel.rules["layers.*.self_attn.[q_proj,k_proj,v_proj]"]: colwise splits '
        "model.layers.0.self_attn.q_proj.weight (64, 64) along dim 0 (64 output features), but 64 % tp(3) = 1 "
        "(and 11 more modules)",
        'tensor_parallel.rules["layers.*.self_attn.o_proj"]: rowwise splits model.layers.0.self_attn.o_proj.weight '
        "(64, 64) along dim 1 (64 input features), but 64 % tp(3) = 1 (and 3 more modules)",
        'tensor_parallel.rules["layers.*.mlp.[gate_proj,up_proj]"]: colwise splits '
        "model.layers.0.mlp.gate_proj.weight (128, 64) along dim 0 (128 output features), but 128 % tp(3) = 2 "
        "(and 7 more modules)",
        'tensor_parallel.rules["layers.*.mlp.down_proj"]: rowwise splits model.layers.0.mlp.down_proj.weight '
        "(64, 128) along dim 1 (128 input features), but 128 % tp(3) = 2 (and 3 more modules)",
        "tensor_parallel.rules.embed_tokens: vocab_embedding splits model.embed_tokens.weight (128, 64) along dim 0 "
        "(128 vocabulary rows), but 128 % tp(3) = 2",
        "tensor_parallel.rules.lm_head: vocab_loss splits lm_head.weight (128, 64) along dim 0 (128 output "
        "features), but 128 % tp(3) = 2",
        "mesh.tp: tp(3) does not divide the attention heads of model.layers.[0-3] (heads 4 % 3 = 1, kv_heads "
        "2 % 3 = 2) at module model.layers.0.self_attn.q_proj (Linear), op aten.linear.default, "
        "source modeling_llama.py:243; each tp rank must hold whole heads, so use a tp that divides both, or keep "
        "the attention whole: tensor_parallel.rules for the other modules only (the MLP), none for the attention's"]


def test_tp_must_divide_kv_heads(llama: ModelGraph) -> None:
    plan = edit(llama, lambda p: setattr(p, "mesh", Mesh(pp=2, dp=1, tp=4)))
    assert problems(plan, llama) == [
        "mesh.tp: tp(4) does not divide the attention heads of model.layers.[0-3] (heads 4 % 4 = 0, kv_heads "
        "2 % 4 = 2) at module model.layers.0.self_attn.q_proj (Linear), op aten.linear.default, "
        "source modeling_llama.py:243; each tp rank must hold whole heads, so use a tp that divides both, or keep "
        "the attention whole: tensor_parallel.rules for the other modules only (the MLP), none for the attention's"]


def test_tp_style_must_fit_the_module(llama: ModelGraph, gpt2: ModelGraph, mixtral: ModelGraph) -> None:
    plan = edit(llama, lambda p: p.tensor_parallel.rules.update({"layers.*.mlp": "colwise", "norm": "rowwise"}))
    assert problems(plan, llama) == [
        'tensor_parallel.rules["layers.*.mlp"]: colwise applies to Conv1D / Embedding / Linear modules, but '
        "model.layers.0.mlp is LlamaMLP (and 3 more modules)",
        "tensor_parallel.rules.norm: rowwise applies to Conv1D / Embedding / Linear modules, but model.norm is "
        "LlamaRMSNorm"]
    # GPT-2's Conv1D keeps weight as (in, out): colwise splits dim 1.
    gpt2_plan = Plan(mesh=Mesh(tp=5), tensor_parallel=TensorParallel(rules={"h.*.mlp.c_fc": "colwise"}))
    assert problems(gpt2_plan, gpt2, devices=5) == [
        'tensor_parallel.rules["h.*.mlp.c_fc"]: colwise splits transformer.h.0.mlp.c_fc.weight (64, 256) along dim 1 '
        "(256 output features), but 256 % tp(5) = 1 (and 1 more module)"]
    validate_plan(Plan(mesh=Mesh(tp=4), tensor_parallel=TensorParallel(rules={"h.*.mlp.c_fc": "colwise"})), gpt2,
                  None, devices=4)
    # Experts are split along the expert dimension.
    moe = Plan(mesh=Mesh(tp=3), tensor_parallel=TensorParallel(rules={"layers.*.mlp.experts": "expert"}))
    assert problems(moe, mixtral, devices=3) == [
        'tensor_parallel.rules["layers.*.mlp.experts"]: expert splits model.layers.0.mlp.experts.gate_up_proj '
        "(4, 256, 64) along dim 0 (4 experts), but 4 % tp(3) = 1 (and 1 more module)"]
    validate_plan(dataclasses.replace(moe, mesh=Mesh(tp=2)), mixtral, None, devices=2)


def test_tp_rules_conflicts_and_missing_rules(llama: ModelGraph) -> None:
    plan = edit(llama, lambda p: p.tensor_parallel.rules.update({"layers.0.self_attn.q_proj": "rowwise"}))
    assert problems(plan, llama) == [
        'tensor_parallel.rules: model.layers.0.self_attn.q_proj is matched by "layers.*.self_attn.[q_proj,k_proj,'
        'v_proj]" (colwise) and by "layers.0.self_attn.q_proj" (rowwise); give each module one style by narrowing '
        "a selector"]
    norules = edit(llama, lambda p: setattr(p.tensor_parallel, "rules", {}))
    assert problems(norules, llama) == [
        "tensor_parallel.rules: empty, but mesh.tp is 2, so the 2 tp ranks would all compute the same thing; add "
        "rules or set mesh.tp to 1"]


def test_unknown_kinds_list_the_allowed_values(llama: ModelGraph) -> None:
    def change(p: Plan) -> None:
        p.schedule.kind = "1F1B"
        p.tensor_parallel.rules["lm_head"] = "rowwize"
        p.data_parallel.kind = "zero3"
        p.data_parallel.param_dtype = "bfloat16"
        p.data_parallel.reduce_dtype = "float64"
        p.recompute["layers.[2-3]"] = "sometimes"

    assert problems(edit(llama, change), llama) == [
        'schedule.kind: unknown schedule "1F1B"; did you mean "1f1b"? (allowed: "gpipe", "1f1b", "interleaved", "v")',
        'tensor_parallel.rules.lm_head: unknown tensor-parallel style "rowwize"; did you mean "rowwise"? (allowed: '
        '"colwise", "colwise_gather", "rowwise", "vocab_embedding", "vocab_loss", "expert", "replicate")',
        'data_parallel.kind: unknown data-parallel kind "zero3"; did you mean "fsdp"? (allowed: "ddp", "zero1", '
        '"zero2", "fsdp")',
        'data_parallel.param_dtype: unknown dtype "bfloat16"; did you mean "bf16"? (allowed: "fp32", "bf16", "fp16")',
        'data_parallel.reduce_dtype: unknown dtype "float64"; (allowed: "fp32", "bf16", "fp16")',
        'recompute["layers.[2-3]"]: unknown recompute kind "sometimes"; (allowed: "full", "selective", "none")']


def test_schedule_rules(llama: ModelGraph) -> None:
    few = edit(llama, lambda p: setattr(p.schedule, "microbatches", 1))
    assert problems(few, llama) == [
        "schedule.microbatches: 1f1b with pp(2) needs at least 2 microbatches, got 1: its warm-up sends one "
        "microbatch into each of the 2 stages before the first backward, so with fewer the pipeline never fills; "
        'use 2 or more, or kind "gpipe"']
    validate_plan(edit(llama, lambda p: setattr(p, "schedule", Schedule(kind="gpipe", microbatches=1))), llama,
                  None, devices=8)

    def virtual(p: Plan) -> None:
        p.schedule.virtual_stages = 2
        p.stages = [Stage(layers=halves(llama)[0].replace("model.layers.[0-1]", "model.layers.0")),
                    Stage(layers="model.layers.1"), Stage(layers="model.layers.2"),
                    Stage(layers="model.layers.3, model.norm, lm_head")]

    assert problems(edit(llama, virtual), llama) == [
        'schedule.virtual_stages: 2 model chunks per pipeline rank need kind "interleaved", but schedule.kind is '
        '"1f1b"; set kind to "interleaved" or virtual_stages to 1']

    def interleaved(p: Plan) -> None:
        virtual(p)
        p.schedule.kind = "interleaved"
        p.schedule.microbatches = 3

    assert problems(edit(llama, interleaved), llama) == [
        "schedule.microbatches: interleaved runs microbatches in rounds of pp(2) (Narayanan et al. 2021, sec. 2.2), "
        "so it needs a multiple of 2; 3 % 2 = 1 (use 4)"]
    ok = edit(llama, interleaved)
    ok.schedule.microbatches = 4
    validate_plan(ok, llama, None, devices=8)
    bad = edit(llama, lambda p: setattr(p, "schedule", Schedule(kind="gpipe", microbatches=0, virtual_stages=0)))
    assert problems(bad, llama)[:2] == ["schedule.microbatches: expected a positive integer, got 0",
                                        "schedule.virtual_stages: expected a positive integer, got 0"]


def test_fingerprint_mismatch_names_both_models(llama: ModelGraph, gpt2: ModelGraph) -> None:
    plan = good_plan(llama)
    assert problems(plan, gpt2) == [
        f"model.fingerprint: the plan was made for LlamaForCausalLM (fingerprint {llama.fingerprint}), but this "
        f"model is GPT2LMHeadModel (fingerprint {gpt2.fingerprint}); make a new plan for this model (fairscale plan)"]
    other = dataclasses.replace(plan, model=ModelRef(class_="LlamaForCausalLM", fingerprint="0123456789abcdef"))
    assert problems(other, llama) == [
        f"model.fingerprint: the plan was made for LlamaForCausalLM (fingerprint 0123456789abcdef), but this model is "
        f"LlamaForCausalLM (fingerprint {llama.fingerprint}); its parameter names or shapes differ; make a new plan "
        "for this model (fairscale plan)"]
    unpinned = dataclasses.replace(plan, model=ModelRef(class_="GPT", parameters=7))
    assert problems(unpinned, llama) == [
        "model.class: the plan was made for GPT, but this model is LlamaForCausalLM",
        f"model.parameters: the plan says 7, but this model has {llama.num_parameters:,}"]


def test_fsdp_options_with_another_kind_are_not_ignored(llama: ModelGraph) -> None:
    def ddp(p: Plan) -> None:
        p.data_parallel.kind = "ddp"
        p.data_parallel.reshard_after_forward = False

    assert problems(edit(llama, ddp), llama) == [
        'data_parallel.units: "layers.*" is an FSDP option, but data_parallel.kind is "ddp", which would ignore '
        'it; remove it or set kind to "fsdp"',
        'data_parallel.reshard_after_forward: false is an FSDP option, but data_parallel.kind is "ddp", which '
        'would ignore it; remove it or set kind to "fsdp"']
    bucket = edit(llama, lambda p: setattr(p.data_parallel, "bucket_mb", 50.0))
    assert problems(bucket, llama) == [
        'data_parallel.bucket_mb: 50.0 is a DDP/ZeRO option, but data_parallel.kind is "fsdp", which would ignore '
        'it (FSDP communicates per unit); remove it or set kind to "ddp", "zero1" or "zero2"']
    units = edit(llama, lambda p: setattr(p.data_parallel, "units", "layerz.*"))
    assert problems(units, llama) == ['data_parallel.units: "layerz.*" matches no module; did you mean "layers.*"?']


def test_recompute_selectors_and_conflicts(llama: ModelGraph) -> None:
    plan = edit(llama, lambda p: p.recompute.update({"layers.[1-2]": "none", "layers.*.self_atn": "full",
                                                     "layers.*.zzz": "full"}))
    assert problems(plan, llama) == [
        'recompute["layers.*.self_atn"]: "layers.*.self_atn" matches no module; did you mean "layers.*.self_attn"?',
        'recompute["layers.*.zzz"]: "layers.*.zzz" matches no module (modules are: model, model.embed_tokens, '
        "model.layers, model.layers.*, model.layers.*.self_attn, model.layers.*.self_attn.q_proj, "
        "model.layers.*.self_attn.k_proj, model.layers.*.self_attn.v_proj, ... (11 more))",
        'recompute: model.layers.1 is matched by "layers.[0-1]" (full) and by "layers.[1-2]" (none); give each '
        "module one kind by narrowing a selector",
        'recompute: model.layers.2 is matched by "layers.[2-3]" (selective) and by "layers.[1-2]" (none); give '
        "each module one kind by narrowing a selector"]


def test_selector_syntax_errors_are_reported_with_their_path(llama: ModelGraph) -> None:
    def change(p: Plan) -> None:
        p.stages[0].layers = "model.embed_tokens, layers.[0-1"  # the rest of the stage does not matter
        p.recompute = {"layers.[3-1]": "full"}

    assert problems(edit(llama, change), llama) == [
        "stages[0].layers: \"model.embed_tokens, layers.[0-1\": '[' is never closed",
        'recompute["layers.[3-1]"]: "layers.[3-1]": range [3-1] is empty; write the smaller number first']


def test_everything_wrong_at_once(llama: ModelGraph) -> None:
    def change(p: Plan) -> None:
        p.mesh.dp = 3
        p.schedule.microbatches = 1
        p.stages[1].layers = halves(llama)[1].replace("model.layers.[2-3]", "layerz.[2-3]")
        p.data_parallel.kind = "ddp"

    got = problems(edit(llama, change), llama)
    assert [g.split(":")[0] for g in got] == ["mesh", "schedule.microbatches", "stages[1].layers", "stages",
                                              "data_parallel.units"]


def test_without_a_graph_only_model_free_checks_run() -> None:
    plan = Plan(mesh=Mesh(pp=2, dp=3), schedule=Schedule(kind="interleaved", microbatches=3, virtual_stages=2),
                stages=[Stage(layers="a"), Stage(layers="b.[")], recompute={"anything": "full"})
    assert problems(plan, None, devices=4) == [
        "mesh: pp(2) × dp(3) × tp(1) = 6, but 4 devices were given; choose degrees whose product is 4 (e.g. dp 2: "
        "pp(2) × dp(2) × tp(1) = 4)",
        "schedule.microbatches: interleaved runs microbatches in rounds of pp(2) (Narayanan et al. 2021, sec. 2.2), "
        "so it needs a multiple of 2; 3 % 2 = 1 (use 4)",
        "stages: 2 stages given, but pp(2) × virtual_stages(2) = 4 are needed",
        "stages[1].layers: \"b.[\": '[' is never closed"]


def test_plan_for_one_device_with_no_stages(llama: ModelGraph) -> None:
    validate_plan(Plan(), llama, None, devices=1)
    validate_plan(Plan(mesh=Mesh(dp=8)), llama, None, devices=8)
    validate_plan(copy.deepcopy(good_plan(llama)), llama, {"devices": 8})


def test_global_batch_must_split_into_equal_microbatches(llama: ModelGraph) -> None:
    plan = edit(llama, lambda p: setattr(p.schedule, "global_batch", 12))
    assert problems(plan, llama) == [
        "schedule.global_batch: 12 samples do not split into dp(2) × microbatches(4) = 8 equal microbatches "
        "(12 % 8 = 4)"]
    validate_plan(edit(llama, lambda p: setattr(p.schedule, "global_batch", 16)), llama, None, devices=8)
    negative = edit(llama, lambda p: setattr(p.schedule, "global_batch", -1))
    assert problems(negative, llama) == [
        "schedule.global_batch: expected a positive number of samples (or 0: not recorded), got -1"]


def test_heads_only_matter_when_attention_is_sharded(gpt2: ModelGraph) -> None:
    attn = Plan(mesh=Mesh(tp=8), tensor_parallel=TensorParallel(rules={"h.*.attn.c_attn": "colwise"}))
    assert problems(attn, gpt2, devices=8) == [
        "mesh.tp: tp(8) does not divide the attention heads of transformer.h.[0-1] (heads 4 % 8 = 4, kv_heads "
        "4 % 8 = 4) at module transformer.h.0.attn.c_attn (Conv1D), op aten.addmm.default, source "
        "pytorch_utils.py:119; each tp rank must hold whole heads, so use a tp that divides both, or keep "
        "the attention whole: tensor_parallel.rules for the other modules only (the MLP), none for the attention's"]


def test_every_problem_of_a_plan_file_at_once(llama: ModelGraph, tmp_path) -> None:
    """Six seeded mistakes, two that reading the file finds (a misspelt key, a wrong type) and four
    about the model (a stage selector that matches nothing, interleaved with one chunk per rank, a
    tp that splits heads, a recompute range past the last layer), are reported together."""
    data = good_plan(llama).to_dict()
    data["mesh"] = {"pp": 2, "dp": 1, "tp": 4}
    data["model"]["factroy"] = "mypkg.models:build"                   # schema: unknown key
    data["data_parallel"]["bucket_mb"] = "25"                          # schema: wrong type
    data["stages"][1]["layers"] = data["stages"][1]["layers"].replace("layers", "layerz", 1)  # matches nothing
    data["schedule"] = {"kind": "interleaved", "microbatches": 4, "virtual_stages": 1}
    data["recompute"] = {"layers.[0-5]": "full"}                       # 4 layers: 4-5 do not exist
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    plan, schema = Plan.read(path)
    with pytest.raises(PlanError) as info:
        validate_plan(plan, llama, devices=8, source=str(path), schema_problems=schema)
    found = info.value.problems  # (the misspelt stage also leaves model.layers.[2-3] in no stage)
    assert found[0].startswith('model.factroy: unknown key; did you mean "factory"?')
    assert found[1] == 'data_parallel.bucket_mb: expected a number, got "25"'
    assert any(p.startswith('stages[1].layers: "model.layerz.') and "matches no layer" in p for p in found)
    assert any(p.startswith('schedule.virtual_stages: "interleaved" places 2 or more model chunks') for p in found)
    assert any(p.startswith("mesh.tp: tp(4) does not divide the attention heads") for p in found)
    assert 'recompute["layers.[0-5]"]: "layers.[0-5]" names [0-5] but 4-5 match no module; did you mean ' \
        '"layers.[0-3]"?' in found


def test_a_broken_section_is_not_judged_twice(llama: ModelGraph) -> None:
    """A mesh whose tp could not be read takes the default 1; checks that read the mesh would only
    report follow-on errors, so the schema problem stands alone for them."""
    data = good_plan(llama).to_dict()
    data["mesh"]["tp"] = "2"
    plan, schema = read_plan_dict(data)
    with pytest.raises(PlanError) as info:
        validate_plan(plan, llama, devices=8, schema_problems=schema)
    assert info.value.problems == ['mesh.tp: expected an integer, got "2"']
