"""Which modules a model's forward puts in train or eval mode itself.

Distillation code freezes its teacher from inside the forward, where the training loop's
``model.train()`` cannot undo it::

    def forward(self, x, labels):
        self.teacher.eval()                # batch norm on running statistics, dropout off
        with torch.no_grad():
            t = self.teacher(x)

A capture runs that line, so the graph holds the teacher in eval mode whatever flag it had before;
:func:`watch_mode_setters` notes every module whose ``train``/``eval`` the forward calls (a
module's children included, as ``nn.Module.train`` sets them), and ``planner.capture`` records them
in ``ModelGraph.extra[MODES_SET]`` for the runtime's mode check (``fairscale.runtime.modes``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

__all__ = ["MODES_SET", "watch_mode_setters"]

MODES_SET = "modes_set_in_forward"
"""``ModelGraph.extra`` key: the sorted names (``model.named_modules()``) of the modules whose mode
the forward sets."""


@contextlib.contextmanager
def watch_mode_setters(model: nn.Module) -> Iterator[set[str]]:
    """Within the block, collect the names of ``model``'s modules whose ``train(mode)`` (or
    ``eval()``) is called."""
    names = {id(m): name for name, m in model.named_modules()}
    found: set[str] = set()
    original = nn.Module.train

    def train(self: nn.Module, mode: bool = True) -> nn.Module:
        name = names.get(id(self))
        if name is not None:
            found.add(name)
        return original(self, mode)

    nn.Module.train = train  # type: ignore[method-assign, assignment]
    try:
        yield found
    finally:
        nn.Module.train = original  # type: ignore[method-assign]
