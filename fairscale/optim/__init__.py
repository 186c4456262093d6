"""FairScale 0.4.13's ``fairscale.optim``: sharded optimizer (OSS), AdaScale and AMP gradient scalers."""

from fairscale.optim.adascale import AdaScale, AdaScaleWrapper
from fairscale.optim.grad_scaler import GradScaler, ShardedGradScaler
from fairscale.optim.oss import OSS

__all__ = ["OSS", "AdaScale", "AdaScaleWrapper", "GradScaler", "ShardedGradScaler"]
