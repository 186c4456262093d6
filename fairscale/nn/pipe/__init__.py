"""FairScale 0.4.13's ``fairscale.nn.pipe``: single-process GPipe, balance helpers, skip connections."""

from fairscale.nn.pipe.pipe import BalanceError, Pipe

__all__ = ["Pipe", "BalanceError"]
