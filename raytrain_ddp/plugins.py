"""Plug-ins: the user's own model, dataset or loss, named by import path.

``--model mypkg.models:build`` names a callable in an importable module. The
driver imports it first, so a typo fails in one line before anything starts;
each worker imports it again, with the directory it was found in added to
``sys.path`` (a module next to the user's script works on a local Ray and on
a shared filesystem).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from raytrain_ddp.errors import ConfigError


def load_object(path: str, flag: str) -> Callable:
    """The callable at `pkg.module:name`; ConfigError naming the flag and the path otherwise."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # the user's module may raise anything while importing
        raise ConfigError(f"{flag} {path!r}: cannot import {module_name}: {type(err).__name__}: {err}") from None
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{flag} {path!r}: module {module_name} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{flag} {path!r} is a {type(target).__name__}, not a callable")
    return target


def import_root(path: str) -> str | None:
    """The sys.path entry `path`'s module was imported from (None for built-in modules)."""
    module_name = path.partition(":")[0]
    module = sys.modules.get(module_name)
    module_file = getattr(module, "__file__", None)
    if module_file is None:
        return None
    root = Path(module_file).resolve().parent
    depth = module_name.count(".") + (Path(module_file).name == "__init__.py")
    for _ in range(depth):
        root = root.parent
    return str(root)


def add_import_roots(roots: list[str]) -> None:
    """Make the driver's plug-in modules importable in this (worker) process."""
    for root in roots:
        if root not in sys.path:
            sys.path.insert(0, root)


def call_plugin(fn: Callable, flag: str, label: str, *args: Any) -> Any:
    """Call a plug-in; its own exception becomes one line naming the flag."""
    try:
        return fn(*args)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"{flag} {label}: raised {type(err).__name__}: {err}") from None


def describe(fn: Callable) -> str:
    """`module:qualname` for a Python API callable (what config.toml records)."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def make_loss(obj: Callable) -> Callable:
    """A loss given as a class (nn.CrossEntropyLoss) is instantiated; a function is used as is."""
    return cast(Callable, obj()) if inspect.isclass(obj) else obj


TASK_METHODS = ("training_step", "validation_step")


def make_task(task: Any, config: Any, label: str) -> Any:
    """The --task object: a class is made with the config when its constructor takes an argument, else with none;
    an object is used as it is. ConfigError when it lacks training_step or validation_step."""
    if inspect.isclass(task):
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        takes_config = any(p.kind in positional for p in inspect.signature(task).parameters.values())
        task = call_plugin(task, "--task", label, *([config] if takes_config else []))
    missing = [name for name in TASK_METHODS if not callable(getattr(task, name, None))]
    if missing:
        raise ConfigError(f"--task {label}: {type(task).__name__} has no {' or '.join(missing)} method")
    return task
