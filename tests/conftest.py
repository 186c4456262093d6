import os

import torch

# One intra-op thread: tests fork ranks, and 2 cores are shared by every rank.
torch.set_num_threads(1)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# CPU clusters are planned with Cluster.cpu's fixed figures, not this machine's measured ones (a
# calibration would make plans depend on the machine and its load); tests of the calibration
# cache turn it back on in a temporary directory.
os.environ["FAIRSCALE_NO_CALIBRATE"] = "1"
os.environ["FAIRSCALE_CACHE_DIR"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"fairscale-test-cache-{os.getpid()}")
# Every pipeline in the suite runs under the NCCL semantics checker (fairscale.runtime.nccl_check):
# its point-to-point is matched per rank pair in order, without tags, and checked for NCCL's
# rendezvous deadlocks, on gloo.
os.environ.setdefault("FAIRSCALE_NCCL_CHECK", "1")


def pytest_xdist_auto_num_workers(config) -> int:  # type: ignore[no-untyped-def]
    """``-n auto`` (pyproject's addopts): a worker per core this process may run on, at most 4. Each
    worker's multi-rank tests fork up to 8 ranks; more workers than cores only time-share them."""
    return max(1, min(4, len(os.sched_getaffinity(0))))
