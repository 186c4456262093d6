"""Plan <-> JSON: exact round trips, no-overwrite saves, and schema errors asserted by their text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.plan import (DataParallel, Mesh, ModelRef, Plan, PlanError, Predicted, Schedule, Stage,
                          TensorParallel)


def full_plan() -> Plan:
    """Every field set to a non-default value, floats included."""
    return Plan(
        version=1,
        model=ModelRef(class_="LlamaForCausalLM", fingerprint="3f2a9c", parameters=6738415616,
                       factory="mypkg.models:build_llama"),
        cluster={"preset": "h100-sxm", "nodes": 2, "gpus_per_node": 8, "bw": [1.5e11, 2.5e10], "x": None},
        mesh=Mesh(pp=2, dp=4, tp=2, ep=2),
        schedule=Schedule(kind="interleaved", microbatches=8, virtual_stages=2, global_batch=64),
        stages=[Stage(layers="embed_tokens, layers.[0-7]"), Stage(layers="layers.[8-15]"),
                Stage(layers="layers.[16-23]"), Stage(layers="layers.[24-31], norm, lm_head")],
        tensor_parallel=TensorParallel(rules={"layers.*.self_attn.[q_proj,k_proj,v_proj]": "colwise",
                                              "layers.*.self_attn.o_proj": "rowwise"},
                                       sequence_parallel=True),
        data_parallel=DataParallel(kind="fsdp", units="layers.*", reshard_after_forward=False, param_dtype="bf16",
                                   reduce_dtype="fp16", offload=True, prefetch=False, bucket_mb=12.5),
        recompute={"layers.[0-7]": "full", "layers.[8-15]": "selective"},
        batch_norm="local",
        predicted=Predicted(step_time_s=0.1234567890123, tflops_per_device=312.0000001, memory_gib=[71.5, 1 / 3],
                            comm_gib_per_step=2.0 ** -20, bubble=0.1, hardware_tflops_per_device=400.5, mfu=0.41,
                            hfu=0.53, devices_used=7, notes=["bf16 compute, fp32 master weights"]),
    )


def test_every_field_is_set_to_a_non_default() -> None:
    import dataclasses

    def walk(a: object, b: object, path: str) -> None:
        for f in dataclasses.fields(a):  # type: ignore[arg-type]
            x, y = getattr(a, f.name), getattr(b, f.name)
            if dataclasses.is_dataclass(x):
                walk(x, y, f"{path}.{f.name}")
            elif f.name != "version":
                assert x != y, f"{path}.{f.name} is left at its default"

    walk(full_plan(), Plan(), "plan")


def test_json_round_trip_is_exact() -> None:
    plan = full_plan()
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text
    assert type(again.predicted.memory_gib[0]) is float
    assert json.loads(text)["model"]["class"] == "LlamaForCausalLM"  # JSON key, not the Python name


def test_integers_in_float_fields_read_as_floats() -> None:
    plan = Plan.from_json('{"version": 1, "data_parallel": {"bucket_mb": 25}, "predicted": {"memory_gib": [1, 2]}}')
    assert plan.data_parallel.bucket_mb == 25.0 and type(plan.data_parallel.bucket_mb) is float
    assert plan.predicted.memory_gib == [1.0, 2.0] and all(type(x) is float for x in plan.predicted.memory_gib)
    assert Plan.from_json(plan.to_json()) == plan


def test_a_minimal_file_takes_defaults() -> None:
    assert Plan.from_json('{"version": 1}') == Plan()
    assert Plan.from_dict({"version": 1, "mesh": {"dp": 8}}) == Plan(mesh=Mesh(dp=8))


def test_save_load_round_trip_and_no_overwrite(tmp_path: Path) -> None:
    plan = full_plan()
    path = plan.save(tmp_path / "plan.json")
    assert Plan.load(path) == plan
    assert path.read_text() == plan.to_json()
    other = Plan(mesh=Mesh(dp=8))
    with pytest.raises(FileExistsError) as info:
        other.save(path)
    assert str(info.value) == f"{path} exists; pass overwrite=True (CLI: --force) to replace it"
    assert Plan.load(path) == plan  # untouched
    other.save(path, overwrite=True)
    assert Plan.load(path) == other
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temporary left behind


def test_bad_json_names_the_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text('{\n  "version": 1\n  "mesh": {"dp": 2}\n}\n')
    with pytest.raises(PlanError) as info:
        Plan.load(path)
    assert info.value.problems == [
        f"{path}:3:3: not valid JSON: Expecting ',' delimiter\n"
        '        "mesh": {"dp": 2}\n'
        "        ^"]
    assert str(info.value).startswith(f"{path} has 1 problem:\n  - {path}:3:3: not valid JSON")


def test_trailing_comma_and_empty_file() -> None:
    with pytest.raises(PlanError) as info:
        Plan.from_json('{"version": 1,}', source="p.json")
    assert info.value.problems[0].startswith("p.json:1:15: not valid JSON: Expecting property name enclosed in "
                                             "double quotes")
    with pytest.raises(PlanError) as info:
        Plan.from_json("", source="p.json")
    assert info.value.problems[0].startswith("p.json:1:1: not valid JSON: Expecting value")


def test_all_schema_problems_are_reported_at_once() -> None:
    text = json.dumps({
        "version": 1,
        "mesh": {"pp": 1, "tp": "2", "dpp": 2},
        "schedule": {"microbatch": 4, "kind": 3},
        "stages": [{"layers": 3}, "layers.[0-3]", {"layer": "x"}],
        "tensor_parallel": {"rules": {"layers.*.q_proj": 1}, "sequence_parallel": "yes"},
        "data_parallel": {"bucket_mb": "25", "offload": 0},
        "recompute": ["layers.*"],
        "predicted": {"memory_gib": [1.0, "2"]},
        "fsdp": {},
    })
    with pytest.raises(PlanError) as info:
        Plan.from_json(text, source="plan.json")
    assert info.value.problems == [
        'mesh.tp: expected an integer, got "2"',
        'mesh.dpp: unknown key; did you mean "dp"? (allowed: pp, dp, tp, ep)',
        'schedule.microbatch: unknown key; did you mean "microbatches"? (allowed: kind, microbatches, virtual_stages, '
        "global_batch)",
        "schedule.kind: expected a string, got 3",
        "stages[0].layers: expected a string, got 3",
        'stages[1]: expected an object, got "layers.[0-3]"',
        'stages[2].layer: unknown key; did you mean "layers"? (allowed: layers)',
        'tensor_parallel.rules["layers.*.q_proj"]: expected a string, got 1',
        'tensor_parallel.sequence_parallel: expected true or false, got "yes"',
        'data_parallel.bucket_mb: expected a number, got "25"',
        "data_parallel.offload: expected true or false, got 0",
        'recompute: expected an object, got ["layers.*"]',
        'predicted.memory_gib[1]: expected a number, got "2"',
        "fsdp: unknown key; (allowed: version, model, cluster, mesh, schedule, stages, tensor_parallel, "
        "data_parallel, recompute, batch_norm, predicted)",
    ]
    assert info.value.source == "plan.json"
    assert str(info.value).splitlines()[0] == "plan.json has 14 problems:"


def test_booleans_are_not_integers_and_null_is_not_a_value() -> None:
    with pytest.raises(PlanError) as info:
        Plan.from_json('{"version": 1, "mesh": {"dp": true, "tp": 2.0}, "data_parallel": {"units": null}}')
    assert info.value.problems == ["mesh.dp: expected an integer, got true", "mesh.tp: expected an integer, got 2.0",
                                   "data_parallel.units: expected a string, got null"]


def test_version_problems_say_which_versions_are_readable() -> None:
    with pytest.raises(PlanError) as info:
        Plan.from_json('{"version": 2, "mesh": {"whatever": 1}}')
    assert info.value.problems == ["version: plan version 2 cannot be read; this build reads version 1"]
    with pytest.raises(PlanError) as info:
        Plan.from_json('{"mesh": {"dp": 2}}')
    assert info.value.problems == ['version: missing; this build reads plan version 1 (add "version": 1)']
    with pytest.raises(PlanError) as info:
        Plan.from_json('{"version": "1"}')
    assert info.value.problems == ['version: expected an integer, got "1"']


def test_top_level_must_be_an_object() -> None:
    with pytest.raises(PlanError) as info:
        Plan.from_json("[1, 2]", source="p.json")
    assert info.value.problems == ["(top level): expected an object, got [1, 2]"]


def test_repeated_keys_are_reported_not_silently_dropped() -> None:
    text = '{"version": 1, "mesh": {"tp": 2, "tp": 4}, "recompute": {"layers.*": "full", "layers.*": "none"}}'
    with pytest.raises(PlanError) as info:
        Plan.from_json(text)
    assert info.value.problems == [
        "mesh.tp: key appears more than once; JSON keeps only the last one, so remove the others",
        'recompute["layers.*"]: key appears more than once; JSON keeps only the last one, so remove the others']


def test_long_values_are_shortened_in_messages() -> None:
    with pytest.raises(PlanError) as info:
        Plan.from_json(json.dumps({"version": 1, "mesh": {"tp": "x" * 100}}))
    assert info.value.problems == ['mesh.tp: expected an integer, got "' + "x" * 56 + "..."]


def test_a_byte_order_mark_is_tolerated(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(b"\xef\xbb\xbf" + Plan(mesh=Mesh(dp=2)).to_json().encode())  # as some Windows editors save
    assert Plan.load(path) == Plan(mesh=Mesh(dp=2))
