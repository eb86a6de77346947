"""The timeline: a background thread that evaluates the node's model at a fixed interval.

Evaluation takes the model lock, which training holds only while it writes parameters, so
points keep coming while a round waits for a slow neighbour. A model whose evaluation is a
collective (sharded over a machine's ranks) is not started: the training loop records a
point when one is :meth:`Recorder.due`, on every rank together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from gossipmesh.report import TimelinePoint
from gossipmesh.tasks import Evaluation


class Recorder:
    """Args:
    evaluate: held-out loss and accuracy of the current model.
    progress: the point's other fields right now (step, round, train_loss, bytes_sent...).
    lock: the model lock.
    clock: seconds on the report's clock.
    interval: seconds between points.
    on_point: called with each point (progress output).
    """

    def __init__(
        self,
        *,
        evaluate: Callable[[], Evaluation],
        progress: Callable[[], dict[str, Any]],
        lock: AbstractContextManager[object],
        clock: Callable[[], float],
        interval: float,
        on_point: Callable[[TimelinePoint], None],
    ) -> None:
        self.timeline: list[TimelinePoint] = []
        self._evaluate = evaluate
        self._progress = progress
        self._lock = lock
        self._clock = clock
        self._interval = interval
        self._on_point = on_point
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recorder", daemon=True)
        self._next_at = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def due(self) -> bool:
        """Whether the next point is due (for a recorder not started)."""
        return time.monotonic() >= self._next_at

    def stop(self) -> TimelinePoint:
        """Stop sampling (if started) and record one last point of the final model."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()
        return self.record()

    def record(self) -> TimelinePoint:
        with self._lock:
            evaluation = self._evaluate()
        point = TimelinePoint(
            t=round_ms(self._clock()), loss=evaluation.loss, accuracy=evaluation.accuracy, **self._progress()
        )
        self.timeline.append(point)
        self._on_point(point)
        self._next_at = max(self._next_at + self._interval, time.monotonic())
        return point

    def _run(self) -> None:
        while not self._stop.wait(max(0.0, self._next_at - time.monotonic())):
            self.record()


def round_ms(seconds: float) -> float:
    return round(seconds, 3)
