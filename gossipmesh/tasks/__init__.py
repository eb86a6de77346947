"""Training tasks: the built-in ones by name, or a user's own as ``module:function``."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from gossipmesh.tasks.base import (
    IID,
    PRECISIONS,
    Batches,
    DataPartition,
    Evaluation,
    Precision,
    Shard,
    Task,
    device_of,
    partition_indices,
)


def _built_in(module_name: str, class_name: str) -> Callable[[], Task]:
    """A built-in task's factory that imports its module (and torch) when it makes the task,
    not when a --task is parsed."""

    def make() -> Task:
        task: Task = getattr(importlib.import_module(f"gossipmesh.tasks.{module_name}"), class_name)()
        return task

    return make


TASKS: dict[str, Callable[[], Task]] = {
    "digits": _built_in("digits", "DigitsTask"),
    "charlm": _built_in("charlm", "CharLMTask"),
}


class TaskError(ValueError):
    """A task that cannot be found or loaded; the message says what to pass instead."""


@dataclass(frozen=True)
class TaskRef:
    """A task by name: a built-in one, or ``module:function`` (the module imported from the
    working directory or the Python path, as gunicorn does); :meth:`make` builds it."""

    name: str
    factory: Callable[[], Task] = field(compare=False, repr=False)

    @classmethod
    def parse(cls, name: str) -> TaskRef:
        """The task ``name`` refers to; :class:`TaskError` saying what to pass instead."""
        if name in TASKS:
            return cls(name, TASKS[name])
        module_name, colon, function_name = name.partition(":")
        if not colon or not module_name or not function_name:
            raise TaskError(
                f"unknown task {name!r}; choose one of {', '.join(TASKS)}, or give your own as "
                "module:function"
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
        return cls(name, factory)

    def make(self) -> Task:
        return self.factory()

    def __str__(self) -> str:
        return self.name


def load_task(name: str) -> Task:
    return TaskRef.parse(name).make()


__all__ = [
    "IID",
    "PRECISIONS",
    "TASKS",
    "Batches",
    "DataPartition",
    "Evaluation",
    "Precision",
    "Shard",
    "Task",
    "TaskError",
    "TaskRef",
    "device_of",
    "load_task",
    "partition_indices",
]
