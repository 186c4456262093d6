"""``fairscale.nn.misc``: :class:`FlattenParamsWrapper`."""

from fairscale.nn.misc.flatten_params_wrapper import FlattenParamsWrapper

__all__ = ["FlattenParamsWrapper"]
