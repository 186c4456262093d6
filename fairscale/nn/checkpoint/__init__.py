"""``fairscale.nn.checkpoint``: activation checkpointing (:func:`checkpoint_wrapper`)."""

from fairscale.nn.checkpoint.checkpoint_activations import (checkpoint_wrapper, disable_checkpointing,
                                                            is_checkpointing, is_recomputing)

__all__ = ["checkpoint_wrapper", "disable_checkpointing", "is_checkpointing", "is_recomputing"]
