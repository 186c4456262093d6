"""Capture every corpus model as a bf16 plan's search costs it, and print how far its saved
activations are from the fp32 capture's bytes halved (what bf16 plans were costed from before).

    python benchmarks/corpus/bf16_capture.py          # ~1.5 min, one process, no ranks

Each model is captured through ``fairscale.api.captured`` in fp32 and in bf16 (traced and
annotated with bf16 parameters and inputs, ``planner.capture.capture(dtype=...)``) on a batch of 4;
the ratio is the bf16 capture's saved bytes over half the fp32 capture's. Above 1: fp32 tensors of
the model's upcasts (norm statistics, fp32 softmax or loss, fp32 recurrent workspaces) that
halving counted at 2 bytes.
"""

from __future__ import annotations

import time
import warnings

from fairscale.api import captured
from fairscale.testing.corpus import models


def main() -> None:
    warnings.filterwarnings("ignore")
    print(f"{'model':28s} {'bf16 / (fp32 / 2)':>18s}  seconds")
    for name, entry in models().items():
        start = time.perf_counter()
        case = entry.build(0)
        batch = case.make_batch(0, 4)
        try:
            fp32 = captured(case.model, batch, loss_fn=case.loss_fn)
            bf16 = captured(case.model, batch, loss_fn=case.loss_fn, dtype="bf16")
        except Exception as exc:  # noqa: BLE001 - reported per model, the sweep goes on
            print(f"{name:28s} {'not captured':>18s}  {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
            continue
        ratio = sum(layer.saved_bytes for layer in bf16.layers) / (sum(layer.saved_bytes for layer in fp32.layers) / 2)
        print(f"{name:28s} {ratio:18.3f}  {time.perf_counter() - start:.1f}")


if __name__ == "__main__":
    main()
