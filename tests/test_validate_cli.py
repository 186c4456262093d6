"""`fairscale validate` on a real captured model (no attention facts filled in by the test) reports six
seeded mistakes at once, two the file reader finds and four about the model, each with its JSON path,
and exits 1 before anything is launched (issue 15, item 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fairscale import cli


@pytest.fixture(autouse=True)
def _factories_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def test_six_seeded_mistakes_are_all_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    made = tmp_path / "plan.json"
    assert cli.main(["plan", "cli_factories:gpt", "--devices", "4", "--global-batch", "8", "-o", str(made),
                     "--constraints", '{"mesh": {"pp": 2, "dp": 1, "tp": 2}, "schedule": {"kind": "1f1b"}}']) == 0
    data = json.loads(made.read_text())
    assert data["tensor_parallel"]["rules"]  # attention is sharded, so the heads matter
    data["model"]["factroy"] = "mypkg:build"                                    # 1. unknown key
    data["data_parallel"]["bucket_mb"] = "25"                                   # 2. wrong type
    data["mesh"]["tp"] = 4                                                      # 3. the GPT has 2 heads
    data["schedule"].update(kind="interleaved", virtual_stages=1)               # 4. one chunk per rank
    data["recompute"] = {"layers.[0-3]": "full"}                                # 5. 2 blocks
    last = len(data["stages"]) - 1
    data["stages"][last]["layers"] = data["stages"][last]["layers"].replace("lm_head", "lm_haed")  # 6.
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    capsys.readouterr()
    code = cli.main(["validate", str(bad), "--devices", "8"])
    err = capsys.readouterr().err
    assert code == 1
    problems = [line[4:] for line in err.splitlines() if line.startswith("  - ")]
    expected = [
        'model.factroy: unknown key; did you mean "factory"?',
        'data_parallel.bucket_mb: expected a number, got "25"',
        "mesh.tp: tp(4) does not divide the attention heads of layers.[0-1] (heads 2 % 4 = 2, kv_heads 2 % 4 = 2)",
        'schedule.virtual_stages: "interleaved" places 2 or more model chunks on each pipeline rank, got '
        "virtual_stages 1",
        'recompute["layers.[0-3]"]: "layers.[0-3]" names [0-3] but 2-3 match no module; did you mean "layers.[0-1]"?',
        f'stages[{last}].layers: "lm_haed" matches no layer; did you mean "lm_head"?',
    ]
    for want in expected:
        assert any(p.startswith(want) for p in problems), (want, err)
