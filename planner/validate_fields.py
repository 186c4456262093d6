"""Field-level helpers of plan validation shared by its checks (``planner.validate``,
``planner.validate_tp``): positive integers, enumerations with "did you mean", selector parsing,
selectors that match nothing or cut through a layer, and rules that claim the same module twice.
Each appends problems naming their JSON path; none raises."""

from __future__ import annotations

from typing import Sequence

from planner.graph import ModelGraph
from planner.messages import closest, describe
from planner.selectors import Selector, SelectorError, format_layers, format_ranges, parse_selector, suggest

__all__ = ["ALIASES", "check_positive", "check_choice", "parse_field", "check_matches", "module_names", "outline",
           "short_list", "check_conflicts", "fp16_problem"]


def check_positive(path: str, value: int, problems: list[str]) -> bool:
    if value < 1:
        problems.append(f"{path}: expected a positive integer, got {value}")
        return False
    return True


ALIASES = {"zero3": "fsdp", "zero-3": "fsdp", "bfloat16": "bf16", "float32": "fp32", "float16": "fp16",
            "half": "fp16", "float": "fp32", "pipedream": "1f1b", "interleaved_1f1b": "interleaved"}
"""Names other tools use for our values (ZeRO-3 is what FSDP does; torch dtype names)."""


def check_choice(path: str, value: str, allowed: Sequence[str], what: str, problems: list[str]) -> bool:
    if value in allowed:
        return True
    close = ALIASES.get(value.lower()) if value.lower() in ALIASES else None
    close = close if close in allowed else closest(value, allowed)
    hint = f'did you mean "{close}"? ' if close else ""
    quoted = ", ".join(f'"{a}"' for a in allowed)
    problems.append(f"{path}: unknown {what} {describe(value)}; {hint}(allowed: {quoted})")
    return False


def parse_field(path: str, text: str, problems: list[str], *, example: str) -> Selector | None:
    if not text.strip():
        problems.append(f'{path}: empty; write a selector, e.g. "{example}"')
        return None
    try:
        return parse_selector(text)
    except SelectorError as exc:
        problems.append(f"{path}: {exc}")
        return None


def check_matches(path: str, sel: Selector, names: Sequence[str], what: str, problems: list[str],
               *, modules: Sequence[str] = ()) -> None:
    """Report each pattern of ``sel`` that selects none of ``names`` (``what``: layer or module)."""
    for pat in sel.unmatched(names):
        hits = parse_selector(pat).select(modules)
        held = [n for n in names if any(n.startswith(h + ".") for h in hits)]
        if held:  # a container of layers, e.g. "model.layers"
            problems.append(f'{path}: "{pat}" matches {short_list(hits)}, which holds layers {short_list(held)}; '
                            f'a stage lists layers, e.g. "{format_layers(held)}"')
            continue
        owners = [n for n in names if any(h.startswith(n + ".") for h in hits)]
        if owners:
            problems.append(f'{path}: "{pat}" matches {short_list(hits)}, inside layer{"s" if len(owners) > 1 else ""} '
                            f"{short_list(owners)}; a stage holds whole layers (layers are: {outline(names)})")
            continue
        fix = suggest(pat, list(names) + list(modules))
        hint = f'; did you mean "{fix}"?' if fix else f" ({what}s are: {outline(names)})"
        problems.append(f'{path}: "{pat}" matches no {what}{hint}')
    unmatched = set(sel.unmatched(names))
    for p in sel.patterns:
        if p.text in unmatched:
            continue
        for group, absent, fixed in p.absent_numbers(names):
            hint = f'did you mean "{fixed}"?' if fixed else f"{what}s are: {outline(names)}"
            problems.append(f'{path}: "{p.text}" names {group} but {format_ranges(absent)} '
                            f'match{"es" if len(absent) == 1 else ""} no {what}; {hint}')


def module_names(graph: ModelGraph) -> list[str]:
    return [m for m in graph.modules if m]


def outline(names: Sequence[str], limit: int = 8) -> str:
    """Module paths with integer segments folded to ``*``, deduplicated: the shape of the model."""
    seen: list[str] = []
    for name in names:
        folded = ".".join("*" if seg.isdigit() else seg for seg in name.split("."))
        if folded not in seen:
            seen.append(folded)
    more = f", ... ({len(seen) - limit} more)" if len(seen) > limit else ""
    return ", ".join(seen[:limit]) + more


def short_list(names: Sequence[str], limit: int = 3) -> str:
    text = format_layers(list(names))
    parts = text.split(", ")
    return text if len(parts) <= limit else ", ".join(parts[:limit]) + f", ... ({len(parts) - limit} more)"


def check_conflicts(path: str, parsed: list[tuple[str, Selector, str]], modules: list[str], what: str,
               problems: list[str]) -> None:
    """Report modules that two selectors give different values."""
    seen: dict[tuple[int, int], list[str]] = {}
    for m in modules:
        hits = [i for i, (_, sel, _) in enumerate(parsed) if sel.matches(m)]
        for a in hits:
            for b in hits:
                if a < b and parsed[a][2] != parsed[b][2]:
                    seen.setdefault((a, b), []).append(m)
    for (a, b), mods in seen.items():
        (ka, _, va), (kb, _, vb) = parsed[a], parsed[b]
        problems.append(f'{path}: {short_list(mods)} {"is" if len(mods) == 1 else "are"} matched by "{ka}" ({va}) '
                        f'and by "{kb}" ({vb}); give each module one {what} by narrowing a selector')


def fp16_problem(path: str, value: str) -> str | None:
    """fp16 compute or reduction needs loss scaling (small gradients flush to zero below 6e-8 and
    large ones overflow past 65504), which the runtime does not implement: refuse it rather than
    train wrongly. bf16 has fp32's range and needs none."""
    if value != "fp16":
        return None
    return (f'{path}: "fp16" needs dynamic loss scaling, which the runtime does not implement (gradients would '
            'underflow or overflow silently); use "bf16" (same speed on A100/H100, fp32\'s range) or "fp32"')
