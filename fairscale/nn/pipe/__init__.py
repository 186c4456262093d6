"""FairScale 0.4.13's ``fairscale.nn.pipe``: single-process GPipe, balance helpers, skip connections.

``is_checkpointing()`` / ``is_recomputing()`` tell a layer whether it runs inside a checkpointed
cell's first forward or its backward-time recomputation (e.g. to skip side effects once).
"""

from fairscale.nn.pipe.batchnorm import is_checkpointing, is_recomputing
from fairscale.nn.pipe.pipe import BalanceError, Pipe

__all__ = ["Pipe", "BalanceError", "is_checkpointing", "is_recomputing"]
