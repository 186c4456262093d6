"""The device lint of tests/test_device_lint.py over the classic modules too (fairscale.nn,
fairscale.optim, fairscale.internal, fairscale.experimental): every tensor they create names its
device, so the classic wrappers work on GPU ranks (NCCL collectives need device tensors)."""

from __future__ import annotations

from pathlib import Path

from test_device_lint import problems_in

ROOT = Path(__file__).resolve().parents[2]
CLASSIC = ["fairscale/nn", "fairscale/optim", "fairscale/internal", "fairscale/experimental"]


def test_classic_modules_create_tensors_on_named_devices() -> None:
    problems = [p for d in CLASSIC for f in sorted((ROOT / d).rglob("*.py"))
                for p in problems_in(f.read_text(), str(f.relative_to(ROOT)))]
    assert not problems, "tensor factories without a device in the classic modules:\n" + "\n".join(problems)
