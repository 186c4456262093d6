"""Random ops under tensor parallelism: a tp group's ranks draw from one random state.

A dropout on a value the tp ranks replicate (the residual stream, attention probabilities of
unsplit heads) must draw the same mask on each of them, and ``passes.tp`` gives a split value's
dropout one mask stream per rank from a seed every rank draws alike (``tp_ops.sharded_dropout``):
both need the ranks of a tp group to start each step from the same random state. A script that
seeds each rank differently, as nanoGPT's ``torch.manual_seed(1337 + rank)`` or accelerate's
``set_seed(seed + process_index)`` do, had given each tp rank its own masks: the ranks' copies of a
replicated activation disagreed, and so did the gradients of replicated weights (layer norms), which
drifted apart from one step to the next, silently (``pm.state_dict()`` saved tp rank 0's). So, for a
rank graph that draws random numbers, each step starts by giving every rank of the tp group the
random state of its tp rank 0 (host and device generator): the data-parallel and pipeline ranks keep
the streams the script gave them, as in Megatron-LM, where data-parallel ranks share a seed only if
the script seeds them alike.
"""

from __future__ import annotations

from typing import Iterable

import torch

from passes.ops import comm
from passes.ops.random_ops import random_nodes

__all__ = ["draws_random", "share_random_state"]


def draws_random(graphs: Iterable[torch.fx.GraphModule]) -> bool:
    """Whether any of this rank's stage graphs draws random numbers with effect (dropout with p > 0)."""
    return any(random_nodes(gm) for gm in graphs)


def share_random_state(device: torch.device) -> None:
    """Give this rank the random state of its tp group's rank 0 (collective over ``tp``)."""
    host = torch.get_rng_state().to(device)
    comm.broadcast_(host, "tp")
    torch.set_rng_state(host.cpu())
    if device.type == "cuda":
        state = torch.cuda.get_rng_state(device).to(device)
        comm.broadcast_(state, "tp")
        torch.cuda.set_rng_state(state.cpu(), device)
