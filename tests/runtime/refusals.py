"""What the tests of scripts as users write them share: a call's refusal as text, and their dp2 plan."""

from __future__ import annotations

from typing import Any, Callable

from planner.plan import Mesh, Plan, Schedule

BATCH = 8
DP2 = Plan(mesh=Mesh(dp=2), schedule=Schedule(kind="1f1b", microbatches=1, global_batch=BATCH))


def refused(fn: Callable[[], Any]) -> str:
    """``"ErrorType: message"`` of what ``fn()`` raised, or ``"(not refused)"``."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return "(not refused)"
