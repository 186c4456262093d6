"""Lint: every tensor the passes and the runtime create names its device.

A factory call without ``device=`` (``torch.zeros(n)``) makes a CPU tensor, which is right on a CPU
rank and wrong on a GPU rank (a device mismatch, or a silent host round trip). This test parses
``passes/`` and ``fairscale/runtime/`` with ``ast`` and fails on:

* a tensor factory call (``torch.zeros``, ``empty``, ``ones``, ``full``, ``arange``, ``tensor``, ...)
  without ``device=``;
* one whose device is literally the CPU (``device="cpu"``), unless a ``# lint: cpu -- <reason>``
  comment on the call's lines or the line above says why the host is meant (a host copy for
  checkpoint reading, a routing table that must be host integers, ...).

``*_like`` and ``Tensor.new_*`` calls inherit their input's device and are not factories here. The
run-time guard in ``tests/runtime/test_device_guard.py`` catches what a lint cannot see (calls
through other names, devices computed wrongly).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = [ROOT / "passes", ROOT / "fairscale" / "runtime"]
FACTORIES = frozenset({"zeros", "ones", "empty", "full", "arange", "range", "tensor", "as_tensor", "rand", "randn",
                       "randint", "randperm", "eye", "linspace", "logspace", "empty_strided", "scalar_tensor",
                       "Generator"})
MARK = "# lint: cpu --"
HOST_ONLY = {"fairscale/runtime/calibrate.py": "calibrate_cpu measures gloo CPU ranks, by design on the host"}
"""Files whose tensors are all meant for the host, with the reason."""


def _files() -> list[Path]:
    return sorted(p for d in SCANNED for p in d.rglob("*.py"))


def _is_cpu_literal(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0] == "cpu"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "device":
        return bool(node.args) and _is_cpu_literal(node.args[0])
    return False


def problems_in(source: str, name: str) -> list[str]:
    """``name:line: <what>`` for every factory call in ``source`` the lint rejects."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and node.func.attr in FACTORIES):
            continue
        where = f"{name}:{node.lineno}"
        device = next((k.value for k in node.keywords if k.arg == "device"), None)
        if device is None:
            out.append(f"{where}: torch.{node.func.attr}(...) without device=")
            continue
        if _is_cpu_literal(device):
            span = lines[max(0, node.lineno - 4):node.end_lineno or node.lineno]  # the statement's lines and above
            if not any(MARK in line and line.split(MARK, 1)[1].strip() for line in span):
                out.append(f"{where}: torch.{node.func.attr}(..., device=cpu) without a '{MARK} <reason>' comment")
    return out


def test_every_factory_call_in_passes_and_the_runtime_names_its_device():
    found = [p for f in _files() if str(f.relative_to(ROOT)) not in HOST_ONLY
             for p in problems_in(f.read_text(), str(f.relative_to(ROOT)))]
    assert not found, "tensor factory calls without an explicit device:\n" + "\n".join(found)


@pytest.mark.parametrize("code,ok", [
    ("x = torch.zeros(3)", False),
    ("x = torch.zeros(3, device=d)", True),
    ("x = torch.zeros(3, device='cpu')", False),
    ("x = torch.zeros(3, device=torch.device('cpu'))", False),
    ("# lint: cpu -- read into host memory\nx = torch.empty(3, device='cpu')", True),
    ("x = torch.empty(3, device='cpu')  # lint: cpu --", False),  # a mark without a reason
    ("x = torch.zeros_like(y)", True),
    ("x = y.new_zeros(3)", True),
    ("g = torch.Generator()", False),
])
def test_the_lint_itself(code, ok):
    assert (problems_in(code + "\n", "probe.py") == []) == ok
