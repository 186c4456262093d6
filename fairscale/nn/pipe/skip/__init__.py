"""Skip connections for Pipe: ``skippable``, ``stash``, ``pop``, ``Namespace``, ``verify_skippables``."""

from fairscale.nn.pipe.skip.skippable import Namespace, pop, skippable, stash, verify_skippables

__all__ = ["skippable", "stash", "pop", "Namespace", "verify_skippables"]
