"""Time ``fairscale.plan`` on an unmodified Hugging Face model with its default config, and the loss
check's share of it: with the proof on the graph (``planner.row_flow``), and without it (the eager
forward and backward of four rows every plan that cuts the batch had needed).

    python benchmarks/planner/plan_real_model.py                 # GPT-2 (124 M), batch 8 x 1024, 4 devices
    python benchmarks/planner/plan_real_model.py --rows 4 --seq 512 --devices 8

Prints one line per run: the plan, the wall time of ``fairscale.plan`` and of the eager check in it.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("FAIRSCALE_NO_CALIBRATE", "1")  # the same plans everywhere: Cluster.cpu's figures

import torch  # noqa: E402

import fairscale  # noqa: E402
import fairscale.loss_check as loss_check  # noqa: E402


def _run(rows: int, seq: int, devices: int, proof: bool) -> None:
    import transformers

    from fairscale.testing.corpus_hf import Labels

    torch.manual_seed(0)
    model = Labels(transformers.GPT2LMHeadModel(transformers.GPT2Config()))
    ids = torch.randint(0, model.inner.config.vocab_size, (rows, seq))
    eager = {"s": 0.0, "calls": 0}
    row_problem, proven = loss_check.row_problem, loss_check.proven_row_by_row

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return row_problem(*args, **kwargs)
        finally:
            eager["s"] += time.perf_counter() - start
            eager["calls"] += 1

    loss_check.row_problem = timed
    if not proof:
        loss_check.proven_row_by_row = lambda *a, **k: False  # what every plan that cut the batch ran before
    try:
        start = time.perf_counter()
        plan = fairscale.plan(model, (ids, ids), devices=devices)
        total = time.perf_counter() - start
    finally:
        loss_check.row_problem, loss_check.proven_row_by_row = row_problem, proven
    m = plan.mesh
    print(f"GPT-2 default config, batch {rows} x {seq}, {devices} devices, proof {'on ' if proof else 'off'}: "
          f"fairscale.plan {total:.1f} s, of it the eager check {eager['s']:.1f} s ({eager['calls']} run(s)); "
          f"plan pp{m.pp} dp{m.dp} tp{m.tp}, {plan.schedule.microbatches} microbatch(es), {plan.data_parallel.kind}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--devices", type=int, default=4)
    args = ap.parse_args()
    for proof in (True, False):
        _run(args.rows, args.seq, args.devices, proof)


if __name__ == "__main__":
    main()
