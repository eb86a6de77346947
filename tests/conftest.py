from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator
from multiprocessing.context import SpawnContext

import pytest


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
    """A mesh forks its nodes from this process: no other thread may hold a lock then. A thread
    an earlier test asked to stop may still be finishing on a busy machine: it gets 30 s."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread():
            thread.join(30)
    assert threading.active_count() == 1, [t.name for t in threading.enumerate()]
