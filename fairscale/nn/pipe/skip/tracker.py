"""Where stashed skip tensors wait for their pop: one tracker per micro-batch inside a Pipe."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Generator, Hashable

__all__ = ["SkipTracker", "current_skip_tracker", "use_skip_tracker"]


class SkipTracker:
    """Stashed tensors keyed by (namespace, name).

    ``keep_popped``: inside a Pipe a popped tensor stays until the micro-batch is done, because an
    activation-checkpointed partition pops it again when it recomputes in backward. Outside a Pipe
    (the default tracker) a pop removes it, so nothing is kept alive between calls.
    """

    def __init__(self, *, keep_popped: bool = False) -> None:
        self.tensors: dict[tuple[Hashable, str], Any] = {}
        self.keep_popped = keep_popped

    def save(self, ns: Hashable, name: str, tensor: Any) -> None:
        self.tensors[(ns, name)] = tensor

    def load(self, ns: Hashable, name: str) -> Any:
        key = (ns, name)
        if key not in self.tensors:
            raise RuntimeError(f"skip {name!r} was popped before it was stashed (or popped twice); "
                               "check the order of the stash and pop layers")
        return self.tensors[key] if self.keep_popped else self.tensors.pop(key)


_local = threading.local()
_DEFAULT = SkipTracker()


def current_skip_tracker() -> SkipTracker:
    return getattr(_local, "tracker", None) or _DEFAULT


@contextlib.contextmanager
def use_skip_tracker(tracker: SkipTracker) -> Generator[None, None, None]:
    old = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        yield
    finally:
        _local.tracker = old
