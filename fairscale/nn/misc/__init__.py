"""``fairscale.nn.misc``: :class:`FlattenParamsWrapper`, the gradient/parameter buckets
:class:`GradBucket` and :class:`ParamBucket`, and ``checkpoint_wrapper`` (FairScale's older import
path of :func:`fairscale.nn.checkpoint.checkpoint_wrapper`)."""

from fairscale.nn.checkpoint.checkpoint_activations import checkpoint_wrapper
from fairscale.nn.misc.flatten_params_wrapper import FlattenParamsWrapper
from fairscale.nn.misc.param_bucket import GradBucket, ParamBucket

__all__ = ["FlattenParamsWrapper", "GradBucket", "ParamBucket", "checkpoint_wrapper"]
