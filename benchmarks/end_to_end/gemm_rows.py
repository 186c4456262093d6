"""A linear's forward+backward rate by rows and weight shape, one process on one thread:

    python benchmarks/end_to_end/gemm_rows.py

The cost model rates a tensor-parallel rank's narrower GEMMs by weight size alone
(``planner.cost_gemm.gemm_rate``), from shapes calibration times on 256 × tp rows; this table shows
how much the rows change a narrow GEMM's rate (the end-to-end README, "Eighth round"). Each entry
is the median of 5 runs of ``reps`` calls, in CPU seconds of this process, GFLOP/s at 6 FLOPs per
row and weight element (forward, input and weight gradients).
"""

from __future__ import annotations

import statistics
import time

import torch

ROWS = (256, 512, 1024, 2048)
SHAPES = ((128, 512), (128, 256), (128, 128), (128, 64), (128, 32), (128, 16))


def rate(rows: int, n_in: int, n_out: int, reps: int = 200) -> float:
    """GFLOP/s of ``linear(x[rows, n_in], w[n_out, n_in]).backward(grad)``."""
    x = torch.randn(rows, n_in, requires_grad=True)
    w = torch.randn(n_out, n_in, requires_grad=True)
    grad = torch.randn(rows, n_out)
    for _ in range(20):  # warm-up
        torch.nn.functional.linear(x, w).backward(grad)
    runs = []
    for _ in range(5):
        start = time.process_time()
        for _ in range(reps):
            torch.nn.functional.linear(x, w).backward(grad)
        runs.append((time.process_time() - start) / reps)
    return 6 * rows * n_in * n_out / statistics.median(runs) / 1e9


def main() -> None:
    torch.set_num_threads(1)  # what fairscale.launch gives each CPU rank
    print("rows  " + " ".join(f"{i}x{o:<4d}" for i, o in SHAPES))
    for rows in ROWS:
        print(f"{rows:<5d} " + " ".join(f"{rate(rows, i, o):7.1f}" for i, o in SHAPES))


if __name__ == "__main__":
    main()
