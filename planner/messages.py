"""Wording shared by every plan and CLI error: JSON paths, found values, and "did you mean"."""

from __future__ import annotations

import difflib
import json
from typing import Any, Sequence

__all__ = ["json_path_key", "describe", "closest"]


def json_path_key(path: str, key: str) -> str:
    """``mesh`` + ``tp`` -> ``mesh.tp``; keys that are not identifiers are quoted: ``rules["a.*"]``."""
    if key.isidentifier():
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key)}]"


def describe(value: Any) -> str:
    """A found value as the user wrote it in JSON, shortened."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def closest(word: str, allowed: Sequence[str], *, cutoff: float = 0.6) -> str | None:
    """The allowed word most like ``word`` (difflib ratio; ties go to the longer common prefix)."""
    lower = {a.lower(): a for a in allowed}
    word = word.lower()  # "1F1B" is one letter case away from "1f1b", not two letters
    close = difflib.get_close_matches(word, list(lower), n=5, cutoff=cutoff)
    if not close:
        return None

    def score(option: str) -> tuple[float, int]:
        prefix = next((i for i, (a, b) in enumerate(zip(word, option)) if a != b), min(len(word), len(option)))
        return difflib.SequenceMatcher(None, word, option).ratio(), prefix

    return lower[max(close, key=score)]
