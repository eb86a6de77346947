"""Built-in training tasks, by name."""

from __future__ import annotations

from collections.abc import Callable

from tasks.base import Batches, Evaluation, Shard, Task, parse_dirichlet, partition_indices
from tasks.digits import DigitsTask

TASKS: dict[str, Callable[[], Task]] = {"digits": DigitsTask}


def load_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]()


__all__ = [
    "TASKS",
    "Batches",
    "Evaluation",
    "Shard",
    "Task",
    "load_task",
    "parse_dirichlet",
    "partition_indices",
]
