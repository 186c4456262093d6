"""Module-path selectors: how a plan names modules and layers.

A selector is a comma-separated list of patterns over dotted module paths::

    embed_tokens, layers.[0-15]
    layers.*.self_attn.[q_proj,k_proj,v_proj]
    **.mlp.*_proj

Each pattern is a dotted list of segments. A segment is

* a literal (``layers``, ``q_proj``);
* ``*``: exactly one segment, any name (``*`` never crosses a dot);
* ``**``: any number of segments, including none;
* a glob with ``*`` and ``?`` inside one segment (``*_proj``, ``h?``);
* a bracket group: comma-separated alternatives, each an inclusive integer range ``0-11`` or a
  literal/glob: ``[0-11]``, ``[0-3,8,10-11]``, ``[q_proj,k_proj,v_proj]``. Groups may sit inside a
  segment (``block_[0-3]``). Commas inside brackets do not split patterns. Because brackets mean
  groups, fnmatch's character classes (``[abc]``) are not available.

A pattern matches a path if it matches the whole path or a dot-aligned suffix of it, so
``layers.[0-3]`` matches ``model.layers.2`` but not ``model.layers.12`` or ``xlayers.2``.

Usage::

    sel = parse_selector("embed_tokens, layers.[0-1]")
    sel.select(["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"])
    # -> ["model.embed_tokens", "model.layers.0", "model.layers.1"]
    format_layers([f"model.layers.{i}" for i in range(16)])   # -> "model.layers.[0-15]"
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["Selector", "SelectorError", "Pattern", "parse_selector", "stage_layers", "format_layers", "format_ranges",
           "suggest"]

_MAX_RANGE = 100_000
"""Largest number of integers one range may span (ranges are expanded into the regex)."""
_SPECIAL = set("*?[],") | {" ", "\t", "\n"}


def _q(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class SelectorError(ValueError):
    """A selector string that does not parse; the message quotes the pattern and says why."""


@dataclass(frozen=True)
class Pattern:
    """One parsed pattern of a selector."""

    text: str
    """The pattern as written (whitespace stripped)."""
    regex: re.Pattern[str]
    """Compiled matcher over ``"." + path`` (see ``_compile``)."""
    literal: bool = False
    """No wildcard and no group: it matches the module path equal to it and those ending in ``.`` + it."""

    def matches(self, path: str) -> bool:
        if self.literal:  # what the regex says, without building "." + path (a 128-stage plan matches 17k times)
            return path.endswith(self.text) and (len(path) == len(self.text) or path[-len(self.text) - 1] == ".")
        return self.regex.fullmatch("." + path) is not None

    def absent_numbers(self, paths: Sequence[str]) -> list[tuple[str, list[int], str]]:
        """For each bracket group holding numbers (``[0-5]``, ``[0,2,7]``), the numbers that match
        none of ``paths`` when put in the group's place: ``(group, absent, the pattern with only the
        present numbers)``. A range that runs past the last layer is almost always a typo."""
        out = []
        for start, end in _groups(self.text):
            body = self.text[start + 1:end]
            numbers = [n for item in body.split(",") for n in _numbers(item)]
            if not numbers:
                continue
            others = [item.strip() for item in body.split(",") if not _numbers(item)]
            absent = [n for n in numbers
                      if not any(_compile(self.text[:start] + str(n) + self.text[end + 1:]).fullmatch("." + p)
                                 for p in paths)]
            if absent:
                present = sorted(set(numbers) - set(absent))
                kept = ([format_ranges(present)] if present else []) + others
                fixed = self.text[:start] + "[" + ",".join(kept) + "]" + self.text[end + 1:] if kept else ""
                out.append((self.text[start:end + 1], absent, fixed))
        return out


def _groups(pat: str) -> list[tuple[int, int]]:
    """(start, end) indices of each ``[...]`` group of a pattern (groups never nest)."""
    spans, start = [], -1
    for i, ch in enumerate(pat):
        if ch == "[":
            start = i
        elif ch == "]" and start >= 0:
            spans.append((start, i))
            start = -1
    return spans


def _numbers(item: str) -> list[int]:
    """The integers a bracket alternative names: ``3`` -> [3], ``0-2`` -> [0, 1, 2], a name -> []."""
    m = _RANGE.fullmatch(item)
    if m:
        return list(range(int(m.group(1)), int(m.group(2)) + 1))
    return [int(item)] if item.strip().isdigit() else []


@dataclass(frozen=True)
class Selector:
    """A parsed selector: a list of patterns; a path is selected if any pattern matches it."""

    text: str
    """The selector as written."""
    patterns: tuple[Pattern, ...]
    """Its patterns in the order written."""

    def matches(self, path: str) -> bool:
        return any(p.matches(path) for p in self.patterns)

    def select(self, paths: Iterable[str]) -> list[str]:
        """The paths that some pattern matches, in the order given."""
        return [p for p in paths if self.matches(p)]

    def unmatched(self, paths: Iterable[str]) -> list[str]:
        """Texts of the patterns that match none of ``paths`` (for error messages)."""
        paths = list(paths)
        return [p.text for p in self.patterns if not any(p.matches(x) for x in paths)]

    def __str__(self) -> str:
        return ", ".join(p.text for p in self.patterns)


def parse_selector(text: str) -> Selector:
    """Parse a selector string; raise :class:`SelectorError` saying what is wrong and where."""
    if not isinstance(text, str):
        raise SelectorError(f"a selector is a string, got {type(text).__name__}")
    patterns = []
    for raw in _split_top(text, ","):
        pat = raw.strip()
        if not pat:
            raise SelectorError(f"{_q(text)} has an empty pattern (two commas in a row, or a comma at an end)")
        patterns.append(Pattern(text=pat, regex=_compile(pat), literal=not _SPECIAL & set(pat)))
    return Selector(text=text, patterns=tuple(patterns))


def stage_layers(selectors: Sequence[Selector], names: Sequence[str]) -> list[list[str]]:
    """Each stage's layers (the ``names`` it selects, in order), less a layer that it matches only
    by a suffix and another stage matches whole. A pattern also matches the paths that end in it,
    so the search's stages of torchvision's ResNet ("conv1, bn1, layer1, ..." then "...,
    layer3.0.conv1, layer3.0.bn1, ...") put layer3.0.conv1 in both stages, and every pp plan of it
    was refused ("layer3.0.conv1 is already in stages[0]"): the top-level conv1 can be named no
    other way. Two stages that match a layer whole still both hold it (a plan's overlap)."""
    picked = [sel.select(names) for sel in selectors]
    whole = [{n for n in stage if any(_matches_whole(p, n) for p in sel.patterns)}
             for sel, stage in zip(selectors, picked)]
    return [[n for n in stage if n in whole[i] or not any(n in w for j, w in enumerate(whole) if j != i)]
            for i, stage in enumerate(picked)]


def _matches_whole(pattern: Pattern, path: str) -> bool:
    """Whether ``pattern`` matches ``path`` from its first segment (not only a suffix of it)."""
    if not pattern.matches(path):
        return False
    segments = _split_top(pattern.text, ".")
    return "**" in (seg.strip() for seg in segments) or len(segments) == path.count(".") + 1


def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside brackets; check brackets are balanced and not nested."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise SelectorError(f"{_q(text)}: brackets cannot nest (column {i + 1})")
            depth = 1
        elif ch == "]":
            if not depth:
                raise SelectorError(f"{_q(text)}: ']' without '[' (column {i + 1})")
            depth = 0
        elif ch == sep and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise SelectorError(f"{_q(text)}: '[' is never closed")
    parts.append(text[start:])
    return parts


def _compile(pat: str) -> re.Pattern[str]:
    # Match against "." + path: each segment consumes its leading dot, so suffix alignment is a
    # plain "(\.[^.]+)*" prefix and "**" is the same thing in the middle.
    any_segments = r"(?:\.[^.]+)*"
    out = [any_segments]
    for seg in _split_top(pat, "."):
        seg = seg.strip()
        if not seg:
            raise SelectorError(f"{_q(pat)} has an empty segment (two dots in a row, or a dot at an end)")
        if seg == "**":
            out.append(any_segments)
        elif "**" in seg:
            raise SelectorError(f"{_q(pat)}: '**' must be a whole segment, as in 'a.**.b'")
        else:
            out.append(r"\." + _segment_regex(seg, pat))
    return re.compile("".join(out))


def _segment_regex(seg: str, pat: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(seg):
        ch = seg[i]
        if ch == "[":
            end = seg.index("]", i)
            out.append(_group_regex(seg[i + 1:end], pat))
            i = end + 1
            continue
        if ch in " \t\n":
            raise SelectorError(f"{_q(pat)}: whitespace inside a pattern")
        out.append(_glob_char(ch))
        i += 1
    return "".join(out)


def _glob_char(ch: str) -> str:
    if ch == "*":
        return r"[^.]*"
    if ch == "?":
        return r"[^.]"
    return re.escape(ch)


_RANGE = re.compile(r"\s*(\d+)\s*-\s*(\d+)\s*")


def _group_regex(body: str, pat: str) -> str:
    alts: list[str] = []
    for item in body.split(","):
        m = _RANGE.fullmatch(item)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise SelectorError(f"{_q(pat)}: range [{lo}-{hi}] is empty; write the smaller number first")
            if hi - lo >= _MAX_RANGE:
                raise SelectorError(f"{_q(pat)}: range [{lo}-{hi}] spans more than {_MAX_RANGE} numbers")
            # Longest first, so that the alternation never stops early on a prefix.
            alts.extend(str(n) for n in range(hi, lo - 1, -1))
            continue
        item = item.strip()
        if not item:
            raise SelectorError(f"{_q(pat)}: empty alternative inside [{body}]")
        if "." in item:
            raise SelectorError(f"{_q(pat)}: alternative {_q(item)} holds a dot; alternatives are single "
                                "segments (write separate patterns instead)")
        if "-" in item and item.replace("-", "").strip().isdigit():
            raise SelectorError(f"{_q(pat)}: {_q(item)} is not a range; write it as LOW-HIGH, e.g. 0-11")
        alts.append("".join(_glob_char(c) for c in item))
    return "(?:" + "|".join(alts) + ")"


# --- formatting --------------------------------------------------------------------------------


def format_layers(names: Sequence[str]) -> str:
    """Compress module paths into a short selector that selects exactly them.

    Consecutive names that differ only in one integer segment become one range pattern::

        ["model.embed", "model.layers.0", ..., "model.layers.15", "lm_head"]
        -> "model.embed, model.layers.[0-15], lm_head"

    Gaps become lists (``layers.[0-3,5]``). Names are written in full; since patterns also match
    dot-aligned suffixes, the result may select more from a universe where one name is a suffix of
    another (``b`` and ``a.b``); layer names of a captured graph never are.
    """
    runs: list[_Run] = []
    for name in names:
        for ch in name:
            if ch in _SPECIAL:
                raise ValueError(f"module path {_q(name)} holds {_q(ch)}, which selectors cannot spell")
        segs = name.split(".")
        if not (runs and runs[-1].extend(segs)):
            runs.append(_Run(segs))
    return ", ".join(str(r) for r in runs)


class _Run:
    """Names equal except at one integer segment (``pos``), in the order they came."""

    def __init__(self, segs: list[str]) -> None:
        self.segs = segs
        self.pos = -1
        self.nums: list[int] = []

    def extend(self, segs: list[str]) -> bool:
        if len(segs) != len(self.segs):
            return False
        diff = [i for i, (a, b) in enumerate(zip(self.segs, segs)) if a != b]
        if self.pos < 0:
            # A run of one picks the integer position it ranges over from its second name.
            if len(diff) != 1 or not (_is_int(self.segs[diff[0]]) and _is_int(segs[diff[0]])):
                return False
            self.pos = diff[0]
            self.nums = [int(self.segs[self.pos])]
        elif diff != [self.pos] or not _is_int(segs[self.pos]) or int(segs[self.pos]) in self.nums:
            return False
        self.nums.append(int(segs[self.pos]))
        return True

    def __str__(self) -> str:
        if self.pos < 0:
            return ".".join(self.segs)
        segs = list(self.segs)
        segs[self.pos] = "[" + format_ranges(self.nums) + "]"
        return ".".join(segs)


def _is_int(seg: str) -> bool:
    return seg.isdigit() and str(int(seg)) == seg


def format_ranges(nums: list[int]) -> str:
    """[0, 1, 2, 3, 5, 7, 8] -> "0-3,5,7-8" (runs of consecutive ascending numbers)."""
    runs: list[list[int]] = []
    for n in nums:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    items = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    return ",".join(items)


# --- suggestions -------------------------------------------------------------------------------

_WORD = re.compile(r"(?<![\w*?])([A-Za-z_]\w*)(?![\w*?])")


def suggest(pattern: str, paths: Iterable[str]) -> str | None:
    """A corrected spelling of ``pattern`` that matches some of ``paths``, or None.

    Each literal word of the pattern that is no segment of any path is replaced by the closest
    segment name (difflib), so ``layerz.[0-3]`` becomes ``layers.[0-3]``.
    """
    paths = list(paths)
    vocab = sorted({seg for p in paths for seg in p.split(".") if seg})

    def fix(m: re.Match[str]) -> str:
        word = m.group(1)
        if word in vocab:
            return word
        close = difflib.get_close_matches(word, vocab, n=1, cutoff=0.6)
        return close[0] if close else word

    fixed = _WORD.sub(fix, pattern)
    if fixed == pattern:
        return None
    try:
        pat = parse_selector(fixed)
    except SelectorError:
        return None
    return fixed if pat.select(paths) else None
