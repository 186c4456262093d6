"""The fairscale command, run in-process: plan, validate, report; exit codes 0/1/2; no overwrites."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fairscale import cli
from planner.plan import Mesh, Plan

GPT = "cli_factories:gpt"


@pytest.fixture(autouse=True)
def _factories_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


DDP_ONLY = '{"mesh": {"pp": 1, "tp": 1}, "schedule": {"microbatches": 1}, "data_parallel": {"kind": "ddp"}}'
"""Constraints that pin the search to plain data parallelism (what the old unsearched fallback emitted)."""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_searches_and_writes_the_plan_with_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", GPT, "--devices", "4", "--global-batch", "8", "-o", str(path),
                         "--constraints", DDP_ONLY)
    assert (code, err) == (0, "")
    assert "best:  pp=1 dp=4 tp=1 1f1b m=1 ddp" in out and f"wrote {path}" in out
    plan = Plan.load(path)
    assert (plan.mesh.pp, plan.mesh.dp, plan.mesh.tp) == (1, 4, 1)
    assert plan.data_parallel.kind == "ddp" and plan.predicted.step_time_s > 0
    assert plan.model.class_ == "GPT" and plan.model.factory == GPT and plan.schedule.global_batch == 8
    assert plan.cluster["devices_per_node"] == 4 and plan.cluster["name"] == "cpu"
    # the report follows: repeated blocks fold into one row; the stage total is every parameter
    assert re.search(r"\n +layers\.\[0-1\] +2 × [0-9,]+\n", out)
    assert re.search(rf"\n +total +{plan.model.parameters:,}\n", out)
    assert "precision: fp32 throughout" in out  # CPU ranks stay fp32
    code, out, err = run(capsys, "validate", str(path))
    assert code == 0 and "re-costed on 4 × cpu at global batch 8" in out


def test_plan_to_stdout_is_pure_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", GPT, "--devices", "2")
    assert code == 0
    plan = Plan.from_json(out)  # nothing but the plan on stdout, so it can be piped
    assert plan.mesh.size == 2 and plan.schedule.global_batch == 2
    assert "best:" in err and "captured GPT from cli_factories:gpt" in err


def test_plan_never_overwrites_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    path.write_text("my notes\n")
    code, out, err = run(capsys, "plan", GPT, "--devices", "2", "-o", str(path))
    assert (code, out) == (2, "")
    assert err == f"fairscale plan: error: {path} exists; pass --force to replace it\n"
    assert path.read_text() == "my notes\n"
    code, out, err = run(capsys, "plan", GPT, "--devices", "2", "-o", str(path), "--force")
    assert code == 0 and Plan.load(path).mesh.size == 2


def test_the_cli_and_the_api_return_the_same_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """One way in: the command and fairscale.plan() search with the same rules and settings."""
    import fairscale
    from cli_factories import gpt

    for argv, kwargs in ((["--devices", "4", "--global-batch", "8"], dict(devices=4, global_batch=8)),
                         (["--cluster", "a100-80gb", "--devices", "12", "--global-batch", "24"],
                          dict(cluster="a100-80gb", devices=12, global_batch=24))):
        code, out, err = run(capsys, "plan", GPT, *argv)
        assert code == 0, err
        from_cli = Plan.from_json(out)
        case = gpt()
        from_api = fairscale.plan(case.model, case.make_batch(0, cli.CAPTURE_BATCH), loss_fn=case.loss_fn, **kwargs)
        from_cli.model.factory = ""
        assert from_cli.to_json() == from_api.to_json()


def test_factories_returning_tuples(capsys: pytest.CaptureFixture[str]) -> None:
    for factory in ("cli_factories:mlp_with_loss_fn", "cli_factories:self_loss", "cli_factories:self_loss_by_name"):
        code, out, err = run(capsys, "plan", factory, "--devices", "2")
        assert code == 0, err
        plan = Plan.from_json(out)
        assert plan.model.class_ in ("MLPNet", "_SelfLoss")
        # the example batch's 4 rows, as fairscale.plan; it had been --devices, and parallelize with
        # that batch then failed at the first step (helper-48)
        assert plan.schedule.global_batch == 4


@pytest.mark.parametrize("factory, message", [
    ("cli_factories", "FACTORY 'cli_factories' is not of the form pkg.module:function (or "
                      "path/to/file.py:function)"),
    ("no_such_module_xyz:f", "FACTORY 'no_such_module_xyz:f': cannot import no_such_module_xyz: No module named "
                             "'no_such_module_xyz'"),
    ("cli_factories:gtp", "FACTORY 'cli_factories:gtp': cli_factories has no attribute 'gtp' (callables there: "
                          "gpt, mlp_with_loss_fn, self_loss, self_loss_by_name, module_only, broken, wrong_type)"),
    ("cli_factories:NOT_A_FUNCTION", "FACTORY 'cli_factories:NOT_A_FUNCTION': NOT_A_FUNCTION is a int, not a "
                                     "function"),
    ("cli_factories:module_only", "FACTORY 'cli_factories:module_only' returned a Linear but no example inputs; "
                                  "return a fairscale.testing.models.Case, (model, example_inputs) or "
                                  "(model, example_inputs, loss_fn)"),
    ("cli_factories:broken", "FACTORY 'cli_factories:broken': calling broken() raised RuntimeError: no weights "
                             "here"),
    ("cli_factories:wrong_type", "FACTORY 'cli_factories:wrong_type' returned int; return a "
                                 "fairscale.testing.models.Case, (model, example_inputs) or (model, example_inputs, "
                                 "loss_fn)"),
    ("missing_file.py:f", "FACTORY 'missing_file.py:f': no file missing_file.py"),
])
def test_bad_factories_are_usage_errors(capsys: pytest.CaptureFixture[str], factory: str, message: str) -> None:
    code, out, err = run(capsys, "plan", factory, "--devices", "2")
    assert (code, out, err) == (2, "", f"fairscale plan: error: {message}\n")


def test_factory_from_a_file_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "mymodels.py"
    script.write_text("from fairscale.testing.models import build\n\n"
                      "def tiny():\n    return build('mlp')\n")
    code, out, err = run(capsys, "plan", f"{script}:tiny", "--devices", "2")
    assert code == 0, err
    assert Plan.from_json(out).model.class_ == "MLPNet"



def test_a_recorded_factory_file_is_found_from_another_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``fairscale plan mymodels.py:tiny -o plan.json`` in the user's project records the file as
    given; ``validate`` and ``report`` of that plan from another directory had stopped with
    "FACTORY 'mymodels.py:tiny': no file mymodels.py", saying neither where it looked nor what to do."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir(), elsewhere.mkdir()
    (project / "mymodels.py").write_text("from fairscale.testing.models import build\n\n"
                                         "def tiny():\n    return build('mlp')\n")
    monkeypatch.chdir(project)
    assert run(capsys, "plan", "mymodels.py:tiny", "--devices", "2", "-o", "plan.json")[0] == 0
    monkeypatch.chdir(elsewhere)
    for command in ("validate", "report"):
        code, out, err = run(capsys, command, str(project / "plan.json"))
        assert (code, err) == (0, ""), err
        assert "MLPNet" in out
    (project / "plan.json").rename(elsewhere / "plan.json")  # moved away from its factory: say what to do
    code, out, err = run(capsys, "validate", "plan.json")
    assert code == 2 and "plan.json records model.factory 'mymodels.py:tiny', a file relative to the directory the " \
                         f"plan was made in, but there is no mymodels.py in this directory ({elsewhere})" in err
    assert "or give FACTORY (path/to/mymodels.py:tiny)" in err

@pytest.mark.parametrize("argv, message", [
    (["plan", GPT], "plan needs the devices: give --devices N (CPU ranks here) or --cluster PRESET --nodes K"),
    (["plan", GPT, "--devices", "2", "--nodes", "2"], "--nodes needs --cluster PRESET (a CPU run is one node: use "
                                                       "--devices N)"),
    (["plan", GPT, "--devices", "0"], "--devices must be at least 1, got 0"),
    (["plan", GPT, "--cluster", "a100-80gb", "--nodes", "2", "--devices", "8"],
     "--cluster: 8 devices of a100-80gb (8 per node) take 1 node(s), not 2; give one of nodes= and devices=, or "
     "make them agree"),
])
def test_argument_mistakes_are_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str],
                                            message: str) -> None:
    code, out, err = run(capsys, *argv)
    assert (code, err) == (2, f"fairscale plan: error: {message}\n")


def test_unknown_preset_and_a_batch_that_leaves_devices_idle(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", GPT, "--cluster", "tpu-v9")
    assert code == 2 and err.startswith("fairscale plan: error: --cluster: unknown cluster preset 'tpu-v9'; known "
                                        "presets: ")
    # 6 samples do not split over 4 data-parallel ranks: the plan uses fewer devices and says why
    code, out, err = run(capsys, "plan", GPT, "--devices", "4", "--global-batch", "6", "--constraints",
                         '{"mesh": {"pp": 1, "tp": 1}}')
    assert code == 0, err
    plan = Plan.from_json(out)
    assert plan.mesh.size == 3
    assert any(n.startswith("using 3 of 4 devices; more would be slower: no plan on all 4 devices fits: a "
                            "data-parallel degree must divide the global batch of 6") for n in plan.predicted.notes)


def test_argparse_errors_and_help_return_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert cli.main(["frobnicate"]) == 2
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "Exit codes: 0 success, 1 invalid plan (every problem is printed), 2 usage error." in out
    assert cli.main(["report", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("stages with their layers and parameter counts, per-device memory, predicted step time and "
            "collectives per step") in out


@pytest.fixture
def made(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    path = tmp_path / "plan.json"
    assert run(capsys, "plan", GPT, "--devices", "4", "--global-batch", "8", "-o", str(path), "--constraints",
               DDP_ONLY)[0] == 0
    return path


def test_validate_and_report_a_good_plan(made: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "validate", str(made), GPT)
    assert (code, err) == (0, "")
    fp = Plan.load(made).model.fingerprint
    assert f"{made} is valid for GPT (fingerprint {fp}) on 4 devices" in out
    code, out2, err = run(capsys, "report", str(made))  # the factory comes from the plan
    assert (code, err) == (0, "")
    assert "captured GPT from cli_factories:gpt" in out2
    report = out2[out2.index("plan for GPT"):]
    assert report.splitlines()[:7] == [
        f"plan for GPT (fingerprint {fp}, {Plan.load(made).model.parameters:,} parameters)",
        "mesh: pp(1) × dp(4) × tp(1) = 4 devices",
        "schedule: 1f1b, 1 microbatch",
        "data parallel: ddp, params fp32, gradients reduced in fp32, 25 MiB buckets",
        "tensor parallel: none",
        "recompute: none",
        ""]
    assert "  dp: all-reduce of every gradient, in buckets, over 4 ranks" in report


def test_validate_prints_every_problem_and_exits_1(made: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(made.read_text())
    data["mesh"] = {"pp": 2, "dp": 3, "tp": 1}
    data["data_parallel"]["units"] = "layers.*"
    made.write_text(json.dumps(data))
    code, out, err = run(capsys, "validate", str(made))
    assert code == 1
    assert err == (
        f"{made} has 5 problems:\n"
        "  - mesh: pp(2) × dp(3) × tp(1) = 6, but 4 devices are in the cluster; choose degrees whose product is 4 "
        "(e.g. dp 2: pp(2) × dp(2) × tp(1) = 4)\n"
        "  - schedule.microbatches: 1f1b with pp(2) needs at least 2 microbatches, got 1: its warm-up sends one "
        "microbatch into each of the 2 stages before the first backward, so with fewer the pipeline never fills; "
        'use 2 or more, or kind "gpipe"\n'
        "  - schedule.global_batch: 8 samples do not split into dp(3) × microbatches(1) = 3 equal microbatches "
        "(8 % 3 = 2)\n"
        "  - stages: empty (one stage holding every layer), but pp(2) × virtual_stages(1) = 2 stages are needed\n"
        '  - data_parallel.units: "layers.*" is an FSDP option, but data_parallel.kind is "ddp", which would ignore '
        'it; remove it or set kind to "fsdp"\n')


def test_validate_reports_reading_and_model_problems_together(made: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A misspelt key no longer hides the model checks: the file is read leniently, the model is
    captured, and every problem comes out at once."""
    data = json.loads(made.read_text())
    data["schedule"]["microbatchs"] = 2
    data["recompute"] = {"layers.[0-3]": "full"}  # the GPT has 2 blocks
    made.write_text(json.dumps(data))
    code, out, err = run(capsys, "validate", str(made))
    assert code == 1
    assert err == (
        f"{made} has 2 problems:\n"
        '  - schedule.microbatchs: unknown key; did you mean "microbatches"? (allowed: kind, microbatches, '
        "virtual_stages, global_batch)\n"
        '  - recompute["layers.[0-3]"]: "layers.[0-3]" names [0-3] but 2-3 match no module; did you mean '
        '"layers.[0-1]"?\n')


def test_validate_a_file_that_is_not_json_or_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    path.write_text('{"version": 1,\n "mesh": {"dp": 2,}}\n')
    code, out, err = run(capsys, "validate", str(path), GPT)
    assert (code, out) == (1, "")
    assert err.startswith(f"{path} has 1 problem:\n  - {path}:2:19: not valid JSON: Expecting property name")
    code, out, err = run(capsys, "validate", str(tmp_path / "nope.json"), GPT)
    assert (code, err) == (2, f"fairscale validate: error: {tmp_path / 'nope.json'}: no such file\n")


def test_validate_without_any_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = Plan(mesh=Mesh(dp=2)).save(tmp_path / "plan.json")
    code, out, err = run(capsys, "validate", str(path), "--devices", "2")
    assert (code, err) == (0, "")
    assert out.splitlines()[:2] == [
        "no FACTORY given and the plan records none (model.factory): checked the plan without the model; "
        "selectors, layer coverage, tensor dimensions and the fingerprint were not checked",
        "predictions: as recorded in the plan, not re-costed: no model to cost (give FACTORY)"]
    assert f"{path} is valid for any model on 2 devices" in out
    code, _, err = run(capsys, "validate", str(path), "--devices", "3")
    assert code == 1 and "mesh: pp(1) × dp(2) × tp(1) = 2, but 3 devices were given" in err


def test_hand_edit_loop(made: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """plan -> edit the file (pipeline cut, tp) -> validate shows the problems or the new plan."""
    data = json.loads(made.read_text())
    data["mesh"] = {"pp": 2, "dp": 2, "tp": 1}
    data["schedule"]["microbatches"] = 2
    assert data["stages"] == []  # one stage holding every layer
    data["stages"] = [{"layers": "wte, wpe, layers.0"}, {"layers": "layers.1, ln_f, lm_head"}]
    made.write_text(json.dumps(data, indent=2))
    code, out, err = run(capsys, "validate", str(made))
    assert (code, err) == (0, "")
    assert "mesh: pp(2) × dp(2) × tp(1) = 4 devices" in out
    assert "  pp: 4 point-to-point sends per pipeline replica (activations forward, gradients backward, at 1 cut × " \
           "2 microbatches)" in out
    data["mesh"]["tp"], data["mesh"]["dp"] = 2, 1
    made.write_text(json.dumps(data, indent=2))
    code, out, err = run(capsys, "validate", str(made))
    assert code == 1
    assert err == (f"{made} has 1 problem:\n  - tensor_parallel.rules: empty, but mesh.tp is 2, so the 2 tp ranks "
                   "would all compute the same thing; add rules or set mesh.tp to 1\n")


def test_python_dash_m_runs_the_same_main(tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "fairscale", "validate", str(tmp_path / "absent.json")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == f"fairscale validate: error: {tmp_path / 'absent.json'}: no such file\n"


def test_constraints_are_kept_by_the_search(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", GPT, "--devices", "4", "--global-batch", "8", "--constraints",
                         '{"mesh": {"pp": 2}, "data_parallel": {"kind": "ddp"}}')
    assert code == 0, err
    plan = Plan.from_json(out)
    assert plan.mesh.pp == 2 and plan.data_parallel.kind == "ddp"


def test_dtype_option(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", GPT, "--cluster", "h100", "--devices", "2")
    assert code == 0, err
    assert Plan.from_json(out).data_parallel.param_dtype == "bf16"  # mixed precision by default on GPUs
    assert Plan.from_json(out).predicted.notes[0].startswith("precision: mixed, bf16 compute: bf16 parameters and "
                                                             "activations, fp32 master weights and Adam states, "
                                                             "gradients reduced in fp32")
    code, out, err = run(capsys, "plan", GPT, "--cluster", "h100", "--devices", "2", "--dtype", "fp32")
    assert code == 0 and Plan.from_json(out).data_parallel.param_dtype == "fp32"
    assert Plan.from_json(out).predicted.notes[0].startswith("precision: fp32 throughout")
    code, _, err = run(capsys, "plan", GPT, "--devices", "2", "--dtype", "fp64")
    assert code == 2 and "argument --dtype: invalid choice: 'fp64'" in err


def test_constraint_mistakes(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = run(capsys, "plan", GPT, "--devices", "2", "--constraints", '{"mesh": {"pp": 2,}}')
    assert (code, err) == (2, "fairscale plan: error: --constraints:1:19: not valid JSON: Expecting property name "
                              "enclosed in double quotes\n")
    code, _, err = run(capsys, "plan", GPT, "--devices", "2", "--constraints", str(tmp_path / "c.json"))
    assert (code, err) == (2, f"fairscale plan: error: --constraints {str(tmp_path / 'c.json')!r}: neither a JSON "
                              "object nor a file\n")
    code, _, err = run(capsys, "plan", GPT, "--devices", "2", "--constraints", '{"mesh": {"tp": 3}}')
    assert code == 1 and "mesh.tp: tp=3 is not possible here" in err
