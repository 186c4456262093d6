"""FairScale 0.4.13's ``fairscale.nn.moe``: GShard top-2 mixture of experts with all-to-all."""

from fairscale.nn.moe.moe_layer import MOELayer
from fairscale.nn.moe.top2gate import Top2Gate

__all__ = ["MOELayer", "Top2Gate"]
