"""``fairscale.nn.wrap``: wrap submodules (usually in FSDP) by hand or by policy."""

from fairscale.nn.wrap.auto_wrap import (
    ConfigAutoWrap,
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    wrap,
)

__all__ = ["auto_wrap", "config_auto_wrap_policy", "default_auto_wrap_policy", "enable_wrap", "wrap", "ConfigAutoWrap"]
