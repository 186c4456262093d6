"""``torch_version()``: the running torch's version as a comparable tuple."""

from __future__ import annotations

import logging
import re

import torch

__all__ = ["torch_version"]

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)([^+]*)(\+\S*)?$")


def torch_version(version: str = torch.__version__) -> tuple[int, ...]:
    """``(major, minor, patch)`` of ``version`` (``"2.13.0+cpu"`` -> ``(2, 13, 0)``); ``()`` if unparsable.

    Pre-release suffixes (``1.10.0a0+git...``) keep their numbers, with a warning: a test against a
    development build is assumed to be intended.
    """
    m = _VERSION.match(version)
    if m is None:
        return ()
    if m.group(4):
        logging.warning(f"torch pre-release {version}: comparing as {m.group(1)}.{m.group(2)}.{m.group(3)}")
    return tuple(int(m.group(i)) for i in (1, 2, 3))
