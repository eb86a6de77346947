"""Runs one worker per rank in forked processes and collects each one's result."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

JOIN_S = 120.0  # how long a worker may take to exit after sending its result


def run_forked(count: int, target: Callable[..., None], args: Callable[[int], tuple[Any, ...]]) -> list[Any]:
    """``target(*args(rank), out)`` in ``count`` forked processes, each sending one result on
    ``out``; the results by rank."""
    fork = multiprocessing.get_context("fork")
    pipes = [fork.Pipe(duplex=False) for _ in range(count)]
    processes = [fork.Process(target=target, args=(*args(rank), pipes[rank][1])) for rank in range(count)]
    for process in processes:
        process.start()
    results = [receiver.recv() for receiver, _ in pipes]
    for process in processes:
        process.join(timeout=JOIN_S)
    return results
