"""fairscale's runtime: launching ranks, building the device mesh, executing per-rank graphs."""

from fairscale.runtime.launch import RankFailedError, init_distributed, launch, under_torchrun

__all__ = ["launch", "RankFailedError", "init_distributed", "under_torchrun"]
