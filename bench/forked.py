"""Runs one worker per rank in forked processes and collects each one's result."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
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
    results: dict[int, Any] = {}
    waiting = {receiver: rank for rank, (receiver, _) in enumerate(pipes)}
    while waiting:
        multiprocessing.connection.wait([*waiting, *(processes[rank].sentinel for rank in waiting.values())])
        for receiver in [r for r in waiting if r.poll()]:
            results[waiting.pop(receiver)] = receiver.recv()
        # a worker that died without its result (a crash): its peers might wait for it for ever
        if dead := [rank for r, rank in waiting.items() if not processes[rank].is_alive() and not r.poll()]:
            for process in processes:
                process.kill()
            codes = {rank: processes[rank].exitcode for rank in dead}
            raise SystemExit(f"worker(s) {dead} exited without a result (exit codes {codes})")
    for process in processes:
        process.join(timeout=JOIN_S)
    return [results[rank] for rank in range(count)]
