"""The house rules, checked: module line budget, one-way layering, no import circles, a clean type
check of ``planner/`` and ``passes/``, each meta key defined once (beside the pass that writes it,
used through its constant) and listed in ARCHITECTURE.md, whose named files exist. Each failure
names the file and line to look at.

Layering (see ARCHITECTURE.md)::

    planner/      pure: imports nothing of passes/ or fairscale/
    passes/       rewrites graphs: imports planner/, never fairscale/
    passes/ops/   run-time collectives: imports neither planner/ nor the rewriting passes (only the
                  dependency-free planner tables in PLANNER_LEAVES)
    fairscale/runtime/   runs compiled programs: never imports the face (fairscale.api, build, cli,
                  report, demo, check, data_parallel), and from passes/ only the run-time ops and the
                  records passes leave for it (RECORDS), never a pass or the pipeline
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "passes", "fairscale")
LINE_BUDGET = 500
FACE = ("fairscale.api", "fairscale.build", "fairscale.cli", "fairscale.report", "fairscale.demo", "fairscale.check",
        "fairscale.data_parallel")
RECORDS = ("passes.layout", "passes.program", "passes.dp.info", "passes.tp.summary", "passes.loss_count")
"""The records passes leave on rank graphs that the runtime reads: leaves, importing no pass."""
PLANNER_LEAVES = ("planner.collectives", "planner.modpath")
"""Planner tables with no import of this repo, which passes/ops/ may read (one home for a fact
both the cost model and the run-time counters use)."""

# Import circles known and being removed (issue "The house"): none left. The test fails when a new
# circle appears AND when a listed one disappears; keep the set empty (move shared types into a leaf).
KNOWN_CIRCLES: set[frozenset[str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """Every module ``name`` imports (module level and inside functions), with its line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, node.lineno))
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names]  # `from pkg import module`
    return found


MODULES = _modules()
IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _ours(target: str) -> str | None:
    """The module of this repo that an import names (the longest known prefix), or None."""
    while target:
        if target in MODULES:
            return target
        target = target.rpartition(".")[0]
    return None


def _where(name: str, line: int) -> str:
    return f"{MODULES[name].relative_to(ROOT)}:{line}"


def test_modules_stay_within_the_line_budget():
    over = [f"{p.relative_to(ROOT)}: {n} lines" for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > LINE_BUDGET]
    assert not over, f"modules past {LINE_BUDGET} lines; split them along a seam:\n" + "\n".join(over)


def _violations() -> list[str]:
    bad = []
    for name, imports in IMPORTS.items():
        for target, line in imports:
            dep = _ours(target)
            if dep is None:
                continue
            if name.startswith("planner") and not dep.startswith("planner"):
                bad.append(f"{_where(name, line)}: planner/ is pure but imports {dep}")
            elif name.startswith("passes.ops") and not dep.startswith("passes.ops") and dep not in PLANNER_LEAVES:
                bad.append(f"{_where(name, line)}: passes/ops/ is the run-time leaf but imports {dep}")
            elif name in RECORDS and dep.startswith("passes") and not dep.startswith(("passes.ops", *RECORDS)):
                bad.append(f"{_where(name, line)}: {name} is a record the runtime reads but imports the pass {dep}")
            elif name.startswith("passes") and dep.startswith("fairscale"):
                bad.append(f"{_where(name, line)}: passes/ must not import fairscale ({dep})")
            elif name.startswith("fairscale.runtime") and dep.startswith(FACE):
                bad.append(f"{_where(name, line)}: the runtime imports the face ({dep}); hand it what it needs")
            elif name.startswith("fairscale.runtime") and dep.startswith("passes") and dep != "passes" \
                    and not dep.startswith(("passes.ops", *RECORDS)):
                bad.append(f"{_where(name, line)}: the runtime imports the pass {dep}; the face compiles "
                           f"(fairscale.build), the runtime reads only passes.ops and the records {RECORDS}")
    return bad


def test_planner_leaves_import_nothing_of_this_repo():
    bad = [f"{_where(leaf, line)}: {leaf} must stay dependency-free but imports {dep}"
           for leaf in PLANNER_LEAVES for target, line in IMPORTS[leaf] if (dep := _ours(target)) and dep != leaf]
    assert not bad, "\n".join(bad)


def test_layers_point_one_way():
    bad = list(dict.fromkeys(_violations()))  # `from a import b` names a and a.b: report the line once
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def _circles() -> list[list[str]]:
    """Strongly connected components (size > 1) of the intra-repo import graph (Tarjan)."""
    edges = {name: sorted({d for t, _ in imports if (d := _ours(t)) and d != name and not _is_parent(d, name)})
             for name, imports in IMPORTS.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def _is_parent(package: str, module: str) -> bool:
    """``import passes.ops.comm`` runs ``passes/__init__``: a package's own modules may name it."""
    return module.startswith(package + ".")


def test_no_new_import_circles():
    found = {frozenset(c) for c in _circles()}
    new = [sorted(c) for c in found - KNOWN_CIRCLES]
    gone = [sorted(c) for c in KNOWN_CIRCLES - found]
    assert not new, "import circles; move the shared types into a leaf module:\n" + "\n".join(map(str, new))
    assert not gone, f"these circles are gone: remove them from KNOWN_CIRCLES in {Path(__file__).name}: {gone}"


def test_planner_and_passes_type_check():
    if shutil.which("mypy") is None and subprocess.run([sys.executable, "-m", "mypy", "--version"],
                                                        capture_output=True).returncode != 0:
        pytest.fail("mypy is not installed: `pip install -c constraints.txt -e '.[test]'` installs it")
    proc = subprocess.run([sys.executable, "-m", "mypy", "planner", "passes"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, "mypy (file:line: error):\n" + proc.stdout[-6000:] + proc.stderr[-2000:]


ARCHITECTURE = ROOT / "ARCHITECTURE.md"


def _meta_keys() -> dict[str, list[tuple[str, str, int]]]:
    """Meta key value -> [(constant, module, line)] for every module-level ``META_* = "fs_..."``."""
    out: dict[str, list[tuple[str, str, int]]] = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and node.targets[0].id.startswith("META_") and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str) and node.value.value.startswith("fs_"):
                out.setdefault(node.value.value, []).append((node.targets[0].id, name, node.lineno))
    return out


def test_each_meta_key_has_one_home_named_in_architecture():
    keys = _meta_keys()
    twice = [f"{k}: " + ", ".join(f"{_where(m, line)} ({c})" for c, m, line in homes)
             for k, homes in keys.items() if len(homes) > 1]
    assert not twice, "meta keys defined more than once; keep one and import it:\n" + "\n".join(twice)
    rows = ARCHITECTURE.read_text().splitlines()
    missing = [f"{_where(m, line)}: {c} = {k!r}" for k, [(c, m, line)] in keys.items()
               if not any(f"`{c}`" in row and f"`{MODULES[m].relative_to(ROOT)}`" in row for row in rows)]
    assert not missing, "meta keys missing from ARCHITECTURE.md's table (key, constant, module):\n" + "\n".join(missing)


def test_meta_keys_are_not_spelled_out():
    """Code reads and writes meta keys through their constants (or accessors), never as bare strings."""
    values = set(_meta_keys())
    bad = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        defining = {id(n.value) for n in tree.body if isinstance(n, ast.Assign)}
        bad += [f"{_where(name, n.lineno)}: {n.value!r}" for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and n.value in values and id(n) not in defining]
    assert not bad, "bare meta keys; use the META_* constant defined beside the pass that writes it:\n" + \
        "\n".join(bad)


def test_architecture_names_real_files():
    named = sorted(set(re.findall(r"[\w/]+\.(?:py|md)\b", ARCHITECTURE.read_text())))
    gone = [p for p in named if "/" in p and not (ROOT / p).exists()]
    assert not gone, f"ARCHITECTURE.md names files that do not exist: {gone}"
