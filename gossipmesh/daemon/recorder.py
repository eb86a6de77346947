"""The timeline: a background thread that evaluates the node's model at a fixed interval.

Evaluation takes the model lock, which training holds only while it writes parameters, so
points keep coming while a round waits for a slow neighbour.
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

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> TimelinePoint:
        """Stop sampling and record one last point of the final model."""
        self._stop.set()
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
        return point

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            self.record()
            next_at = max(next_at + self._interval, time.monotonic())


def round_ms(seconds: float) -> float:
    return round(seconds, 3)
