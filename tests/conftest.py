from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from multiprocessing.context import SpawnContext

import pytest
import torch
from zmq.utils.garbage import GarbageCollectorThread


def pytest_configure(config: pytest.Config) -> None:
    """Each pytest-xdist worker computes on its share of the cores, and so do the processes it
    starts: with torch's default of a thread per core in every worker, two training tests side
    by side wait on each other's spinning threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def restore_root_logging() -> Iterator[None]:
    """A node run in-process sends the root logger to the stderr pytest captured for that test;
    that stream is closed afterwards, so the handlers are put back for the threads that log on."""
    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)


@pytest.fixture
def spawn() -> Iterator[SpawnContext]:
    """Start helper processes; any still running at the end of the test are killed."""
    context = multiprocessing.get_context("spawn")
    yield context
    for child in multiprocessing.active_children():
        child.kill()
        child.join(5)


@pytest.fixture
def no_other_threads() -> None:
    """A mesh forks its nodes from this process: no other thread may hold a lock then. Threads
    an earlier test asked to stop may still be finishing on a busy machine: they get 30 s in
    all (one that was never asked to stop fails the test then, not after 30 s per thread).
    pyzmq's garbage collector of zero-copy sends stays once a test started it; it blocks in
    ZeroMQ, holds none of our locks, and a forked child starts its own."""
    gc.collect()  # (an optimizer a test left unclosed, and the thread that served its state)
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    deadline = time.monotonic() + 30
    for thread in others:
        if not isinstance(thread, GarbageCollectorThread):
            thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threading.enumerate() if not isinstance(t, GarbageCollectorThread)]
    assert alive == [threading.main_thread().name], alive
