"""Skip connections across Pipe partitions: ``@skippable``, ``stash`` and ``pop`` (torchgpipe's API).

A layer stashes a tensor under a name, and a later layer pops it, even when the two end up in
different partitions::

    @skippable(stash=["1to3"])
    class Layer1(nn.Module):
        def forward(self, x):
            yield stash("1to3", x)
            return self.f(x)

    @skippable(pop=["1to3"])
    class Layer3(nn.Module):
        def forward(self, x):
            skip = yield pop("1to3")
            return self.f(x) + skip

The same names in two places are kept apart by namespaces: ``Layer1().isolate(ns)`` with
``ns = Namespace()``. A Sequential of skippable layers also runs on its own, outside any Pipe.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Generator, Iterable

import torch
from torch import nn

from fairscale.nn.pipe.skip.tracker import current_skip_tracker

__all__ = ["skippable", "stash", "pop", "Namespace", "verify_skippables", "Skippable"]


class Namespace:
    """A namespace for skip names, so that the same name can be used by several layer pairs."""

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace {self.id.hex[:8]}>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other.id == self.id


_DEFAULT_NS: Any = None  # names outside any namespace


class stash:  # noqa: N801 - torchgpipe's spelling
    """``yield stash(name, tensor)`` inside a skippable forward stores ``tensor`` under ``name``."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: torch.Tensor | None) -> None:
        self.name = name
        self.tensor = tensor


class pop:  # noqa: N801
    """``x = yield pop(name)`` inside a skippable forward returns the tensor stashed under ``name``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Skippable(nn.Module):
    """Base of the classes :func:`skippable` makes; wraps one instance of the user's module."""

    module_cls: type[nn.Module]
    stashable_names: frozenset[str]
    poppable_names: frozenset[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module!r})"

    def namespaced(self, name: str) -> tuple[Any, str]:
        return self.namespaces.get(name, _DEFAULT_NS), name

    def stashable(self) -> Iterable[tuple[Any, str]]:
        return [self.namespaced(n) for n in sorted(self.stashable_names)]

    def poppable(self) -> Iterable[tuple[Any, str]]:
        return [self.namespaced(n) for n in sorted(self.poppable_names)]

    def isolate(self, ns: Namespace, *, only: Iterable[str] | None = None) -> "Skippable":
        """Put this layer's skip names (or ``only`` those) in namespace ``ns``; returns ``self``."""
        names = set(only) if only is not None else self.stashable_names | self.poppable_names
        for name in names:
            self.namespaces[name] = ns
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tracker = current_skip_tracker()
        result = self.module(*args, **kwargs)
        if not isinstance(result, Generator):
            return result
        stashed: set[str] = set()
        popped: set[str] = set()
        send: Any = None
        while True:
            try:
                op = result.send(send)
            except StopIteration as done:
                out = done.value
                break
            send = None
            if isinstance(op, stash):
                if op.name not in self.stashable_names:
                    raise RuntimeError(f"'{op.name}' has not been declared as stashable in {type(self).__name__}; "
                                       f"declare it: @skippable(stash=['{op.name}'])")
                tracker.save(*self.namespaced(op.name), op.tensor)
                stashed.add(op.name)
            elif isinstance(op, pop):
                if op.name not in self.poppable_names:
                    raise RuntimeError(f"'{op.name}' has not been declared as poppable in {type(self).__name__}; "
                                       f"declare it: @skippable(pop=['{op.name}'])")
                send = tracker.load(*self.namespaced(op.name))
                popped.add(op.name)
            else:
                raise TypeError(f"a skippable forward may only yield stash(...) or pop(...), got {op!r}")
        missing = (self.stashable_names - stashed) | (self.poppable_names - popped)
        if missing:
            raise RuntimeError(f"{type(self).__name__} declared skips it did not use in this call: {sorted(missing)}; "
                               "every declared stash and pop must happen on every forward")
        return out


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[type[nn.Module]], type[Skippable]]:
    """Class decorator: the module's forward may ``yield stash(name, t)`` and ``t = yield pop(name)``."""
    stashable, poppable = frozenset(stash), frozenset(pop)

    def decorate(cls: type[nn.Module]) -> type[Skippable]:
        return type(cls.__name__, (Skippable,), {"module_cls": cls, "stashable_names": stashable,
                                                 "poppable_names": poppable, "__module__": cls.__module__,
                                                 "__doc__": cls.__doc__})

    return decorate


def verify_skippables(module: nn.Sequential) -> None:
    """Raise ``TypeError`` listing every stash without a later pop, pop without an earlier stash,
    and name stashed or popped twice (in the same namespace)."""
    stashed: set[tuple[Any, str]] = set()
    popped: set[tuple[Any, str]] = set()
    problems: list[str] = []
    for layer in module.children():
        if not isinstance(layer, Skippable):
            continue
        for key in layer.stashable():
            if key in stashed:
                problems.append(f"'{key[1]}' is redeclared as stashable but not isolated by namespace")
            stashed.add(key)
        for key in layer.poppable():
            if key in popped:
                problems.append(f"'{key[1]}' is redeclared as poppable but not isolated by namespace")
            elif key not in stashed:
                problems.append(f"'{key[1]}' is popped before it is stashed (or never stashed)")
            popped.add(key)
    for key in sorted(stashed - popped, key=lambda k: k[1]):
        problems.append(f"'{key[1]}' is stashed but not popped")
    if problems:
        raise TypeError("one or more pairs of stash and pop do not match:\n\n"
                        + "\n".join(f"* {p}" for p in problems))
