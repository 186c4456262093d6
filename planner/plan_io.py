"""Read a plan from JSON, checking its shape and reporting every problem at once.

This is the schema half of plan checking: keys, types and version. What the values mean for a
given model and cluster (selectors that match nothing, a mesh that does not fit the devices, ...)
is checked by ``planner.validate``. Both raise :class:`planner.plan.PlanError`, whose
``problems`` each start with the JSON path they are about::

    plan.json has 2 problem(s):
      - mesh.tp: expected an integer, got "2"
      - schedule.microbatch: unknown key; did you mean "microbatches"? (allowed: kind, microbatches, virtual_stages)
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from typing import Any, Sequence

from planner.plan import PLAN_VERSION, Plan, PlanError

__all__ = ["plan_from_dict", "plan_from_json", "READABLE_VERSIONS", "json_path_key", "describe", "closest"]

READABLE_VERSIONS = (PLAN_VERSION,)
"""Plan file versions this build can read."""


class _Obj(dict):  # type: ignore[type-arg]
    """A JSON object that remembers keys the file repeated (json keeps only the last)."""

    duplicates: list[str]


def _pairs(pairs: list[tuple[str, Any]]) -> _Obj:
    obj = _Obj()
    obj.duplicates = []
    for key, value in pairs:
        if key in obj and key not in obj.duplicates:
            obj.duplicates.append(key)
        obj[key] = value
    return obj


def plan_from_json(text: str, *, source: str = "<string>") -> Plan:
    """Parse plan JSON text. ``source`` (a file name) prefixes syntax errors as ``file:line:col``."""
    try:
        data = json.loads(text, object_pairs_hook=_pairs)
    except json.JSONDecodeError as exc:
        lines = text.splitlines() or [""]
        line = lines[exc.lineno - 1] if exc.lineno - 1 < len(lines) else ""
        caret = " " * (exc.colno - 1) + "^"
        raise PlanError([f"{source}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}\n"
                         f"      {line}\n      {caret}"], source=source) from None
    return plan_from_dict(data, source=source)


def plan_from_dict(data: Any, *, source: str = "plan") -> Plan:
    """Build a :class:`Plan` from parsed JSON; raise PlanError listing every schema problem."""
    problems: list[str] = []
    if not isinstance(data, dict):
        raise PlanError([f"(top level): expected an object, got {describe(data)}"], source=source)
    version = data.get("version", _MISSING)
    readable = ", ".join(str(v) for v in READABLE_VERSIONS)
    if version is _MISSING:
        problems.append(f'version: missing; this build reads plan version {readable} (add "version": {PLAN_VERSION})')
    elif not _is_int(version):
        problems.append(f"version: expected an integer, got {describe(version)}")
        data = {k: v for k, v in data.items() if k != "version"}  # reported once is enough
    elif version not in READABLE_VERSIONS:
        # Nothing else in a file of another version can be judged by this version's schema.
        raise PlanError([f"version: plan version {version} cannot be read; this build reads version {readable}"],
                        source=source)
    plan = _read_dataclass(Plan, data, "", problems)
    if problems:
        raise PlanError(problems, source=source)
    assert isinstance(plan, Plan)
    return plan


_MISSING = object()


def json_path_key(path: str, key: str) -> str:
    """``mesh`` + ``tp`` -> ``mesh.tp``; keys that are not identifiers are quoted: ``rules["a.*"]``."""
    if key.isidentifier():
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key)}]"


def describe(value: Any) -> str:
    """A found value as the user wrote it in JSON, shortened."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_name(f: dataclasses.Field[Any]) -> str:
    return "class" if f.name == "class_" else f.name


def _read_dataclass(cls: type, data: Any, path: str, problems: list[str]) -> Any:
    if not isinstance(data, dict):
        problems.append(f"{path or '(top level)'}: expected an object, got {describe(data)}")
        return None
    fields = {_json_name(f): f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in getattr(data, "duplicates", []):
        problems.append(f"{json_path_key(path, key)}: key appears more than once; JSON keeps only the "
                        "last one, so remove the others")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            problems.append(_unknown_key(path, key, list(fields)))
            continue
        f = fields[key]
        got = _read_value(hints[f.name], value, json_path_key(path, key), problems)
        if got is not _MISSING:
            kwargs[f.name] = got
    return cls(**kwargs)


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


def _unknown_key(path: str, key: str, allowed: list[str]) -> str:
    close = closest(key, allowed)
    hint = f'did you mean "{close}"? ' if close else ""
    return f"{json_path_key(path, key)}: unknown key; {hint}(allowed: {', '.join(allowed)})"


def _read_value(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    """Check ``value`` against the field type ``tp``; append a problem and return _MISSING if wrong."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        got = _read_dataclass(tp, value, path, problems)  # type: ignore[arg-type]
        return _MISSING if got is None else got
    if tp is bool:
        if isinstance(value, bool):
            return value
        return _wrong(path, "true or false", value, problems)
    if tp is int:
        if _is_int(value):
            return value
        return _wrong(path, "an integer", value, problems)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)  # 25 and 25.0 are the same number; keep the field's type exact
        return _wrong(path, "a number", value, problems)
    if tp is str:
        if isinstance(value, str):
            return value
        return _wrong(path, "a string", value, problems)
    if tp is Any:
        return _plain(value)
    if origin is list:
        if not isinstance(value, list):
            return _wrong(path, "an array", value, problems)
        (item_tp,) = typing.get_args(tp)
        n = len(problems)
        items = [_read_value(item_tp, v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return _MISSING if len(problems) > n else items
    if origin is dict:
        if not isinstance(value, dict):
            return _wrong(path, "an object", value, problems)
        _, value_tp = typing.get_args(tp)
        n = len(problems)
        for key in getattr(value, "duplicates", []):
            problems.append(f"{json_path_key(path, key)}: key appears more than once; JSON keeps only "
                            "the last one, so remove the others")
        out = {k: _read_value(value_tp, v, json_path_key(path, k), problems) for k, v in value.items()}
        return _MISSING if len(problems) > n else out
    raise TypeError(f"plan_io cannot read fields of type {tp!r} ({path}); teach _read_value about it")


def _wrong(path: str, expected: str, value: Any, problems: list[str]) -> Any:
    problems.append(f"{path}: expected {expected}, got {describe(value)}")
    return _MISSING


def _plain(value: Any) -> Any:
    """Parsed JSON with the duplicate-tracking objects turned back into plain dicts."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
