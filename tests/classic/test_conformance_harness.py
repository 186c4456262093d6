"""benchmarks/conformance/run.py on a two-file stand-in suite: the CPU conftest sets the spawned
world sizes, per-file pytest runs report their outcomes, and the table and the list of tests that
pass on one side only come out right."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _harness():
    spec = importlib.util.spec_from_file_location("conformance_run", ROOT / "benchmarks/conformance/run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SUITE = {
    "tests/__init__.py": "",
    "tests/nn/__init__.py": "",
    "tests/nn/pipe/__init__.py": "",
    "tests/nn/pipe/test_a.py": (
        "from fairscale.fair_dev.testing.testing import get_world_sizes\n"
        "def test_world_sizes():\n    assert get_world_sizes() == [1, 2]\n"
        "def test_fails():\n    assert False\n"),
    "tests/optim/test_b.py": "def test_ok():\n    pass\n",
}


@pytest.mark.slow  # two pytest subprocesses importing the package (~25 s on a shared machine)
def test_harness_runs_a_suite_and_tabulates(tmp_path: Path) -> None:
    run = _harness()
    for name, text in SUITE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    work = run.make_workspace(run._suite_tests(tmp_path))
    files = run.test_files(work, [])
    assert files == ["tests/nn/pipe/test_a.py", "tests/optim/test_b.py"]
    ours = run.run_side(sys.executable, "ours", work, files, jobs=1, timeout=300, per_test=120)
    assert ours["tests/nn/pipe/test_a.py"]["outcomes"] == {"tests.nn.pipe.test_a::test_world_sizes": "passed",
                                                            "tests.nn.pipe.test_a::test_fails": "failed"}
    # a stand-in "original" that passes everything: one difference, in nn/pipe
    other = {f: {**r, "outcomes": {t: "passed" for t in r["outcomes"]}} for f, r in ours.items()}
    sides = {"original": other, "ours": ours}
    text = run.table(files, sides)
    assert "nn/pipe" in text and "optim" in text
    total = text.splitlines()[-1].split()
    assert total == ["total", "2", "3", "3", "2", "2"]
    assert run.differences(files, sides) == [("tests.nn.pipe.test_a::test_fails", "failed")]
