"""An untraceable model through the public ways in (issue 15, item 5): fairscale.plan and the CLI name
the user's file and line with a few lines around it, and suggest only changes the user can make."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import fairscale
from fairscale import cli
from planner.capture import CaptureError

MODEL = textwrap.dedent("""
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            if h.sum().item() > 0:
                h = h * 2
            return self.b(h).pow(2).mean()


    def build():
        torch.manual_seed(0)
        return Net(), (torch.randn(4, 8),)
""")
LINE = MODEL.splitlines().index("        if h.sum().item() > 0:") + 1


@pytest.fixture
def factory(tmp_path: Path) -> Path:
    path = tmp_path / "item_model.py"
    path.write_text(MODEL)
    return path


def _check(msg: str, path: Path) -> None:
    assert (f"needs a tensor's value, not only its shape at {path}:{LINE} (module (the model), Net.forward), at op "
            "aten.item.default:") in msg, msg
    assert f"  -> {LINE:>4} |         if h.sum().item() > 0:" in msg
    assert "torch.where(condition, a, b)" in msg
    assert not [w for w in ("leaf_modules", "tracer=", "annotate=", "concrete_args", "arg0_1", "%") if w in msg], msg


def test_plan_names_the_line(factory: Path, capfd: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("item_model", factory)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, batch = module.build()
    with pytest.raises(CaptureError) as info:
        fairscale.plan(model, batch, devices=2)
    _check(str(info.value), factory)
    assert len(str(info.value).splitlines()) <= 12
    assert "arg0_1" not in capfd.readouterr().err


def test_the_cli_names_the_line(factory: Path, capfd: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["plan", f"{factory}:build", "--devices", "2"])
    out, err = capfd.readouterr()
    assert code == 2
    assert err.startswith(f"fairscale plan: error: FACTORY '{factory}:build': the model could not be captured: "
                          "could not capture Net: its forward needs"), err
    _check(err, factory)
    assert "arg0_1" not in err and len(err.splitlines()) <= 12
