from __future__ import annotations

import multiprocessing
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
