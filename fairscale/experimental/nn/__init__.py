"""``fairscale.experimental.nn``: :class:`OffloadModel`."""

from fairscale.experimental.nn.offload import OffloadModel

__all__ = ["OffloadModel"]
