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

from fairscale.nn.pipe.microbatch import Batch
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

    def forward(self, input: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A002
        """Run the wrapped forward; pops are loaded before it runs and stashes saved after it
        returns, so that inside a Pipe their phonies attach to this layer's input and output."""
        tracker = current_skip_tracker()
        batch = Batch(input)
        poppable: dict[str, Any] = {}
        for ns, name in self.poppable():
            try:
                poppable[name] = tracker.load(batch, ns, name)
            except KeyError:
                raise RuntimeError(f"'{name}' has not been stashed") from None
        result = self.module(batch.tensor_or_tensors, *args, **kwargs)
        stashed: dict[str, Any] = {}
        if isinstance(result, Generator):
            result = self._dispatch(result, stashed, poppable)
        if poppable:
            raise RuntimeError(f"{_names(poppable)} must be popped but have not been")
        missing = [name for _, name in self.stashable() if name not in stashed]
        if missing:
            raise RuntimeError(f"{_names(missing)} must be stashed but have not been")
        batch = Batch(result)
        for ns, name in self.stashable():
            tracker.save(batch, ns, name, stashed[name])
        return batch.tensor_or_tensors

    def _dispatch(self, gen: Generator, stashed: dict[str, Any], poppable: dict[str, Any]) -> Any:
        send: Any = None
        while True:
            try:
                op = gen.send(send)
            except StopIteration as done:
                return done.value
            send = None
            if isinstance(op, stash):
                if op.name not in self.stashable_names:
                    raise RuntimeError(f"'{op.name}' has not been declared as stashable; declare it: "
                                       f"@skippable(stash=['{op.name}'])")
                stashed[op.name] = op.tensor
            elif isinstance(op, pop):
                if op.name not in self.poppable_names:
                    raise RuntimeError(f"'{op.name}' has not been declared as poppable; declare it: "
                                       f"@skippable(pop=['{op.name}'])")
                send = poppable.pop(op.name)
            else:
                raise TypeError(f"a skippable forward may only yield stash(...) or pop(...), got {op!r}")


def _names(names: Iterable[str]) -> str:
    return ", ".join(f"'{n}'" for n in names)


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[type[nn.Module]], type[Skippable]]:
    """Class decorator: the module's forward may ``yield stash(name, t)`` and ``t = yield pop(name)``."""
    stashable, poppable = frozenset(stash), frozenset(pop)

    def decorate(cls: type[nn.Module]) -> type[Skippable]:
        return type(cls.__name__, (Skippable,), {"module_cls": cls, "stashable_names": stashable,
                                                 "poppable_names": poppable, "__module__": cls.__module__,
                                                 "__doc__": cls.__doc__})

    return decorate


def verify_skippables(module: nn.Sequential) -> None:
    """Raise ``TypeError`` listing every unmatched stash/pop pair among ``module``'s children (by
    child name): a name declared both stashable and poppable by one layer, stashed or popped again
    without a namespace, popped but never stashed before, or stashed but never popped. The same
    name can be reused by isolating the layers in different :class:`Namespace` s."""
    stashed: set[tuple[Any, str]] = set()
    popped: set[tuple[Any, str]] = set()
    problems: list[str] = []
    for layer_name, layer in module.named_children():
        if not isinstance(layer, Skippable):
            continue
        for name in sorted(layer.stashable_names & layer.poppable_names):
            problems.append(f"'{layer_name}' declared '{name}' both as stashable and as poppable")
        for key in layer.stashable():
            if key[1] in layer.poppable_names:
                continue
            if key in stashed:
                problems.append(f"'{layer_name}' redeclared '{key[1]}' as stashable but not isolated by namespace")
                continue
            stashed.add(key)
        for key in layer.poppable():
            if key[1] in layer.stashable_names:
                continue
            if key in popped:
                problems.append(f"'{layer_name}' redeclared '{key[1]}' as poppable but not isolated by namespace")
                continue
            if key not in stashed:
                problems.append(f"'{layer_name}' declared '{key[1]}' as poppable but it was not stashed")
                continue
            popped.add(key)
    for _, name in sorted(stashed - popped, key=lambda k: k[1]):
        problems.append(f"no module declared '{name}' as poppable but stashed")
    if problems:
        raise TypeError("one or more pairs of stash and pop do not match:\n\n" + "\n".join(f"* {p}" for p in problems))
