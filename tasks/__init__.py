"""Training tasks: the built-in ones by name, or a user's own as ``module:function``."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from tasks.base import Batches, Evaluation, Shard, Task, device_of, parse_dirichlet, partition_indices
from tasks.charlm import CharLMTask
from tasks.digits import DigitsTask

TASKS: dict[str, Callable[[], Task]] = {"digits": DigitsTask, "charlm": CharLMTask}


class TaskError(ValueError):
    """A task that cannot be found or loaded; the message says what to pass instead."""


def task_factory(name: str) -> Callable[[], Task]:
    """The function that makes task ``name``: a built-in name, or ``module:function`` (the
    module imported from the working directory or the Python path, as gunicorn does)."""
    if name in TASKS:
        return TASKS[name]
    module_name, colon, function_name = name.partition(":")
    if not colon or not module_name or not function_name:
        raise TaskError(
            f"unknown task {name!r}; choose one of {', '.join(TASKS)}, or give your own as module:function"
        )
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(
            f"task {name!r}: cannot import {module_name!r} ({exc}); run from its folder or add it "
            "to PYTHONPATH"
        ) from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise TaskError(f"task {name!r}: {module_name} has no function {function_name!r}")
    return factory  # type: ignore[no-any-return]


def load_task(name: str) -> Task:
    return task_factory(name)()


__all__ = [
    "TASKS",
    "Batches",
    "Evaluation",
    "Shard",
    "Task",
    "TaskError",
    "device_of",
    "load_task",
    "parse_dirichlet",
    "partition_indices",
    "task_factory",
]
