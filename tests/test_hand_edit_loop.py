"""The hand-edit loop, whole: plan on the CLI → edit the file → validate → parallelize(plan=path) trains.

The edit moves a stage cut, changes tp from 2 to 1 (dp takes the freed ranks) and drops recompute
from a layer; validate re-costs it, and the edited plan then trains 8 ranks exactly like one process.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

import fairscale
from fairscale import cli
from fairscale.testing.reference import Trajectory, compare, train_reference
from planner.selectors import parse_selector

FACTORY = "cli_factories:gpt"
BATCH, STEPS, LR = 8, 3, 1e-3


def _case64():
    import cli_factories

    case = cli_factories.gpt()
    case.model.double()
    return case


def _train(rank: int, world: int, path: str) -> Trajectory:
    case = _case64()
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                               plan=path, optimizer=functools.partial(torch.optim.Adam, lr=LR))
    losses = [pm.train_step(case.make_batch(step, BATCH)) for step in range(STEPS)]
    return Trajectory(losses=losses, params=pm.state_dict())


def test_plan_edit_validate_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    constraints = json.dumps({"mesh": {"pp": 2, "dp": 2, "tp": 2}, "schedule": {"kind": "1f1b", "microbatches": 2},
                              "recompute": {"layers.*": "full"}, "data_parallel": {"kind": "ddp"}})
    assert cli.main(["plan", FACTORY, "--devices", "8", "--global-batch", str(BATCH), "--constraints", constraints,
                     "-o", str(path)]) == 0
    made = json.loads(path.read_text())
    assert made["mesh"] == {"pp": 2, "dp": 2, "tp": 2, "ep": 1}
    [(selector, kind)] = made["recompute"].items()
    assert kind == "full" and parse_selector(selector).select(["wte", "layers.0", "layers.1"]) == ["layers.0", "layers.1"]
    before = made["predicted"]["step_time_s"]

    # the edit: the cut moves after layers.0, tp 2 -> 1 (dp 2 -> 4), layers.1 no longer recomputed
    made["stages"] = [{"layers": "wte, wpe, layers.0"}, {"layers": "layers.1, ln_f, lm_head"}]
    made["mesh"] = {"pp": 2, "dp": 4, "tp": 1}
    made["tensor_parallel"] = {"rules": {}, "sequence_parallel": False}
    made["schedule"]["microbatches"] = 2
    made["recompute"] = {"layers.0": "full"}
    path.write_text(json.dumps(made, indent=2))
    capsys.readouterr()

    assert cli.main(["validate", str(path), "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "mesh: pp(2) × dp(4) × tp(1) = 8 devices" in out
    assert "re-costed on 8 × " in out and "s/step" in out
    assert json.loads(path.read_text()) == made, "validate must never rewrite the user's file"

    reference = train_reference(_case64, steps=STEPS, global_batch=BATCH, lr=LR)
    got = fairscale.launch(_train, devices=8, args=(str(path),))[0]
    compare(reference, got, rtol=1e-10, atol=1e-9)
    assert before > 0


def test_a_bad_edit_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    assert cli.main(["plan", FACTORY, "--devices", "8", "--global-batch", str(BATCH), "-o", str(path)]) == 0
    made = json.loads(path.read_text())
    made["mesh"] = {"pp": 1, "dp": 3, "tp": 2}
    path.write_text(json.dumps(made))
    capsys.readouterr()
    assert cli.main(["validate", str(path), "--devices", "8"]) == 1
    err = capsys.readouterr().err
    assert "mesh: pp(1) × dp(3) × tp(2) = 6, but 8 devices were given" in err
