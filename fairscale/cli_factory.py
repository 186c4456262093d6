"""The command line's factories: ``pkg.module:function`` (or ``path/to/file.py:function``) imported,
called, and what it returned read as a model, an example batch and a loss convention
(``fairscale.cli``'s FACTORY argument, and a plan's ``model.factory``)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torch import nn

from fairscale.runtime.batch_form import keyword_example

__all__ = ["CAPTURE_BATCH", "UsageError", "Loaded", "load_factory", "recorded_factory"]

CAPTURE_BATCH = 2
"""Samples in the example batch a Case is captured with (per-layer facts scale linearly with it)."""


class UsageError(Exception):
    """A command-line mistake; printed without a traceback, exit code 2."""


@dataclass
class Loaded:
    """What a factory gave: the model, an example batch and the loss convention of planner.capture."""

    model: nn.Module
    batch: tuple[Any, ...]
    loss_fn: Callable[..., Any] | None
    make_batch: Callable[[int, int], Any] | None = None
    """A Case's ``make_batch(step, batch_size)``: real batches of any size (``check`` uses it)."""


def load_factory(spec: str) -> Loaded:
    """Import ``pkg.module:function`` (or ``file.py:function``), call it, and read what it returned."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"FACTORY {spec!r} is not of the form pkg.module:function (or path/to/file.py:function)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does, so factories next to the user's files import
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise UsageError(f"FACTORY {spec!r}: no file {path}")
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert loader_spec is not None and loader_spec.loader is not None
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except UsageError:
        raise
    except ImportError as exc:
        raise UsageError(f"FACTORY {spec!r}: cannot import {module_name}: {exc}") from exc
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            names = [n for n, v in vars(module).items() if not n.startswith("_") and callable(v)
                     and getattr(v, "__module__", None) == module.__name__]
            raise UsageError(f"FACTORY {spec!r}: {module_name} has no attribute {attr!r} "
                             f"(callables there: {', '.join(names[:12]) or 'none'})")
        fn = getattr(fn, part)
    if not callable(fn):
        raise UsageError(f"FACTORY {spec!r}: {attr} is a {type(fn).__name__}, not a function")
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - the user's code; report it as a usage problem
        raise UsageError(f"FACTORY {spec!r}: calling {attr}() raised {type(exc).__name__}: {exc}") from exc
    return _read_result(spec, result)


_RETURNS = ("return a fairscale.testing.models.Case, (model, example_inputs) or "
            "(model, example_inputs, loss_fn)")


def _read_result(spec: str, result: Any) -> Loaded:
    if all(hasattr(result, a) for a in ("model", "make_batch", "loss_fn")) and isinstance(result.model, nn.Module):
        return Loaded(result.model, tuple(result.make_batch(0, CAPTURE_BATCH)), result.loss_fn, result.make_batch)
    if isinstance(result, nn.Module):
        raise UsageError(f"FACTORY {spec!r} returned a {type(result).__name__} but no example inputs; {_RETURNS}")
    if isinstance(result, (tuple, list)) and len(result) in (2, 3) and isinstance(result[0], nn.Module):
        inputs = result[1]
        loss_fn = result[2] if len(result) == 3 else None
        if loss_fn is not None and not callable(loss_fn):
            raise UsageError(f"FACTORY {spec!r}: the third item must be a loss function, got {type(loss_fn).__name__}")
        try:  # a dict by name, as fairscale.parallelize takes it (fairscale.runtime.batch_form)
            batch = keyword_example(result[0], inputs, loss_fn) if isinstance(inputs, Mapping) else \
                tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        except TypeError as exc:
            raise UsageError(f"FACTORY {spec!r}: {exc}") from exc
        return Loaded(result[0], batch, loss_fn)
    raise UsageError(f"FACTORY {spec!r} returned {type(result).__name__}; {_RETURNS}")


def recorded_factory(spec: str, plan_path: str | Path) -> str:
    """The factory a plan records (``model.factory``), to load from here. ``fairscale plan`` records
    a file path as given, relative to the directory it ran in: when there is no such file here, the
    one next to the plan file is taken (the plan made in the user's project, validated from another
    directory); when neither exists, a UsageError says where it looked and what to do."""
    module_name, sep, attr = spec.partition(":")
    path = Path(module_name)
    if not sep or not module_name.endswith(".py") or path.is_absolute() or path.is_file():
        return spec
    beside = Path(plan_path).parent / path
    if beside.is_file():
        return f"{beside}:{attr}"
    raise UsageError(f"{plan_path} records model.factory {spec!r}, a file relative to the directory the plan was "
                     f"made in, but there is no {path} in this directory ({os.getcwd()}) nor next to the plan "
                     f"({beside}): run from the directory the plan was made in, or give FACTORY "
                     f"(path/to/{path.name}:{attr})")
