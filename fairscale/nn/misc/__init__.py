"""``fairscale.nn.misc``: :class:`FlattenParamsWrapper`, the gradient/parameter buckets
:class:`GradBucket` and :class:`ParamBucket`, and ``checkpoint_wrapper`` (FairScale's older import
path of :func:`fairscale.nn.checkpoint.checkpoint_wrapper`)."""

from fairscale.nn.checkpoint.checkpoint_activations import checkpoint_wrapper
from fairscale.nn.misc.flatten_params_wrapper import FlattenParamsWrapper

__all__ = ["FlattenParamsWrapper", "checkpoint_wrapper"]
