"""Run FairScale 0.4.13's own test suite against this package and against the original, on CPU.

    python benchmarks/conformance/run.py --suite /path/to/fairscale-0.4.13      # both, side by side
    python benchmarks/conformance/run.py --suite ... --only ours -k nn/moe      # a subset, ours only
    python benchmarks/conformance/run.py --suite ... --json /tmp/conf.json      # keep every outcome
    python benchmarks/conformance/run.py --suite ... --from-json /tmp/orig.json --from-json /tmp/ours.json
                                                        # the table of two one-side runs' --json files

``--suite`` is a checkout of facebookresearch/fairscale at v0.4.13 (or its ``tests/`` folder),
supplied by you: this script downloads nothing. The original runs from its own virtual environment
(``--original-python``, default ``/tmp/fs013/bin/python``), made once with::

    python -m venv --system-site-packages /tmp/fs013
    /tmp/fs013/bin/pip install --no-deps fairscale==0.4.13 parameterized==0.9.0   # keeps the local torch

and ours needs the suite's one test dependency too: ``pip install -c constraints.txt -e '.[conformance]'``.

Ours runs with this repository first on ``PYTHONPATH``. Both run the same copy of the suite, in a
scratch workspace, under the same CPU conftest (``cpu_conftest.py``: gloo, spawned tests at world
sizes 1 and 2), one pytest process per test file so a crash or hang costs one file. The table
counts, per area (the suite's folders), the tests each implementation passes; ``--json`` writes every
test's outcome on both sides, which is what ``README.md``'s list of differences is made from.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_ORIGINAL = Path("/tmp/fs013/bin/python")
PYTEST_INI = "[pytest]\naddopts = -p no:cacheprovider\njunit_family = xunit2\n"


def _suite_tests(path: Path) -> Path:
    tests = path / "tests" if (path / "tests").is_dir() else path
    if not (tests / "nn").is_dir():
        raise SystemExit(f"--suite {path}: no FairScale tests/ folder there (expected tests/nn/...); "
                         "pass a checkout of facebookresearch/fairscale at v0.4.13")
    return tests


def make_workspace(tests: Path) -> Path:
    """A scratch copy of the suite with the CPU conftest at its root (the user's checkout is not touched)."""
    work = Path(tempfile.mkdtemp(prefix="fs-conformance-"))
    shutil.copytree(tests, work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(HERE / "cpu_conftest.py", work / "conftest.py")
    (work / "pytest.ini").write_text(PYTEST_INI)
    return work


def test_files(work: Path, only: list[str]) -> list[str]:
    files = sorted(str(p.relative_to(work)) for p in (work / "tests").rglob("test_*.py"))
    return [f for f in files if not only or any(o in f for o in only)]


def area(test_file: str) -> str:
    """tests/nn/pipe/skip/test_api.py -> nn/pipe; tests/optim/test_oss.py -> optim."""
    parts = Path(test_file).parts[1:-1]
    return "/".join(parts[:2]) if parts else "."


def _env(side: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    if side == "ours":
        env["PYTHONPATH"] = str(ROOT)
    return env


def run_file(python: str, side: str, work: Path, test_file: str, *, timeout: int, per_test: int) -> dict:
    """One pytest process for one test file; returns {test id: outcome} plus the file's status."""
    xml = work / f"junit-{side}-{test_file.replace('/', '_')}.xml"
    cmd = [python, "-m", "pytest", test_file, "-q", f"--junitxml={xml}", f"--timeout={per_test}",
           "-o", "faulthandler_timeout=0"]
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=work, env=_env(side), capture_output=True, text=True, timeout=timeout)
        status, tail = f"exit {proc.returncode}", (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        status, tail = f"timeout {timeout}s", str(e.stdout or "")[-3000:]
    outcomes = _read_junit(xml) if xml.exists() else {}
    return {"file": test_file, "status": status, "seconds": round(time.time() - start, 1),
            "outcomes": outcomes, "tail": tail}


def _read_junit(xml: Path) -> dict[str, str]:
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            out[name] = "failed"
        elif "error" in kinds:
            out[name] = "error"
        elif "skipped" in kinds:
            out[name] = "skipped"
        else:
            out[name] = "passed"
    return out


def run_side(python: str, side: str, work: Path, files: list[str], *, jobs: int, timeout: int,
             per_test: int) -> dict[str, dict]:
    version = subprocess.run([python, "-c", "import fairscale; print(fairscale.__version__, fairscale.__file__)"],
                             cwd=work, env=_env(side), capture_output=True, text=True)
    print(f"[{side}] {python}: fairscale {version.stdout.strip() or version.stderr.strip()[-300:]}", flush=True)
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_file, python, side, work, f, timeout=timeout, per_test=per_test): f
                   for f in files}
        for fut in concurrent.futures.as_completed(futures):
            r = fut.result()
            results[r["file"]] = r
            passed = sum(o == "passed" for o in r["outcomes"].values())
            print(f"[{side}] {r['file']}: {passed}/{len(r['outcomes'])} passed, {r['status']}, {r['seconds']} s",
                  flush=True)
    return results


def table(files: list[str], sides: dict[str, dict[str, dict]]) -> str:
    rows: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for f in files:
        per_side = {s: sides[s][f]["outcomes"] for s in sides}
        tests = set().union(*[set(o) for o in per_side.values()])
        a = area(f)
        rows[a]["files"] += 1
        rows[a]["tests"] += len(tests)
        for s, outcomes in per_side.items():
            rows[a][s] += sum(outcomes.get(t) == "passed" for t in tests)
        if len(sides) == 2:
            rows[a]["both"] += sum(all(o.get(t) == "passed" for o in per_side.values()) for t in tests)
    names = list(sides)
    head = f"{'area':<24}{'files':>6}{'tests':>7}" + "".join(f"{n:>10}" for n in names)
    head += f"{'both':>7}" if len(names) == 2 else ""
    lines = [head, "-" * len(head)]
    total: collections.Counter = collections.Counter()
    for a in sorted(rows):
        total.update(rows[a])
        lines.append(_row(a, rows[a], names))
    lines += ["-" * len(head), _row("total", total, names)]
    return "\n".join(lines)


def _row(name: str, c: collections.Counter, names: list[str]) -> str:
    s = f"{name:<24}{c['files']:>6}{c['tests']:>7}" + "".join(f"{c[n]:>10}" for n in names)
    return s + (f"{c['both']:>7}" if len(names) == 2 else "")


def differences(files: list[str], sides: dict[str, dict[str, dict]]) -> list[tuple[str, str]]:
    """Tests the original passes and ours does not, with our outcome."""
    out = []
    for f in files:
        orig, ours = sides["original"][f]["outcomes"], sides["ours"][f]["outcomes"]
        for t, o in sorted(orig.items()):
            if o == "passed" and ours.get(t) != "passed":
                out.append((t, ours.get(t, "not collected")))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", type=Path, required=True, help="checkout of FairScale v0.4.13 (or its tests/)")
    p.add_argument("--original-python", default=str(DEFAULT_ORIGINAL),
                   help="interpreter whose `import fairscale` is the original 0.4.13")
    p.add_argument("--ours-python", default=sys.executable)
    p.add_argument("--only", choices=["ours", "original"], help="run one side only")
    p.add_argument("-k", dest="select", action="append", default=[],
                   help="run only test files whose path contains this (repeatable)")
    p.add_argument("--jobs", type=int, default=1, help="test files run at once")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per test file")
    p.add_argument("--per-test-timeout", type=int, default=300, help="seconds per test")
    p.add_argument("--json", type=Path, help="write every outcome here")
    p.add_argument("--from-json", type=Path, action="append", default=[],
                   help="instead of running, read the outcomes a run wrote with --json (repeatable: one per side)")
    args = p.parse_args(argv)
    if args.from_json:
        sides, files = {}, []
        for path in args.from_json:
            saved = json.loads(path.read_text())
            sides.update(saved["sides"])
            files = files or saved["files"]
        return _report(files, sides, args.json)

    work = make_workspace(_suite_tests(args.suite))
    files = test_files(work, args.select)
    pythons = {"original": args.original_python, "ours": args.ours_python}
    if args.only:
        pythons = {args.only: pythons[args.only]}
    if "original" in pythons and not Path(pythons["original"]).exists():
        raise SystemExit(f"--original-python {pythons['original']} does not exist; make the venv as this "
                         "script's docstring says, or pass --only ours")
    print(f"workspace {work}; {len(files)} test files", flush=True)
    sides = {side: run_side(py, side, work, files, jobs=args.jobs, timeout=args.timeout,
                            per_test=args.per_test_timeout) for side, py in pythons.items()}
    shutil.rmtree(work, ignore_errors=True)
    return _report(files, sides, args.json)


def _report(files: list[str], sides: dict[str, dict[str, dict]], json_path: Path | None) -> int:
    print()
    print(table(files, sides))
    if len(sides) == 2:
        diff = differences(files, sides)
        print(f"\n{len(diff)} tests pass on the original and not on ours" + (":" if diff else ""))
        for t, o in diff:
            print(f"  {o:<14} {t}")
    if json_path:
        json_path.write_text(json.dumps({"files": files, "sides": sides}, indent=1))
        print(f"\nwrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
