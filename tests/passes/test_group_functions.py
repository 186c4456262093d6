"""Every autograd function of the rank graphs' ops runs its backward under the groups its forward
ran under (``passes.ops.groups.group_function``). ``loss.backward()`` is called outside the module,
where no mesh's table is active; an undecorated function there resolves its axis to the
process-wide group, or fails: sync batch norm's backward did until the last stop."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import torch

import passes.ops
from passes.ops.groups import AxisGroups, current, group_function


def _functions() -> list[type]:
    found = []
    for info in pkgutil.iter_modules(passes.ops.__path__):
        module = importlib.import_module(f"passes.ops.{info.name}")
        found += [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                  if issubclass(cls, torch.autograd.Function) and cls.__module__ == module.__name__]
    return found


def test_every_autograd_function_of_the_ops_remembers_its_forward_groups() -> None:
    functions = _functions()
    assert len(functions) >= 14  # comm's six, dp's three, tp's two, ep's two, batch norm's
    undecorated = [f"{cls.__module__}.{cls.__name__}" for cls in functions
                   if not getattr(cls, "remembers_groups", False)]
    assert not undecorated, f"decorate with passes.ops.groups.group_function: {undecorated}"


def test_a_decorated_backward_runs_under_the_forward_table_outside_it() -> None:
    seen: list[AxisGroups] = []

    @group_function
    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x.clone()

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            seen.append(current())
            return grad

    table = AxisGroups("a module's mesh", owned=False)
    x = torch.ones(2, requires_grad=True)
    with table.active():
        y = Probe.apply(x)
    y.sum().backward()  # outside the table, as loss.backward() runs in a plain loop
    assert seen == [table]
