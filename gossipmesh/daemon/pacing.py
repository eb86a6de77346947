"""Emulated step time, so that many nodes on few cores measure the algorithms, not the CPU."""

from __future__ import annotations

import time


class StepPacer:
    """Stretches each local step to ``max(compute_ms, measured) * slowdown``.

    ``compute_ms`` emulates an accelerator's step time (a sleep fills the rest of the step);
    ``slowdown`` makes this node a straggler by the same mechanism whether or not compute is
    emulated.
    """

    def __init__(self, compute_ms: float = 0.0, slowdown: float = 1.0) -> None:
        self.compute_s = compute_ms / 1000.0
        self.slowdown = slowdown

    def finish_step(self, started: float) -> None:
        """Sleep until the step that began at ``started`` (time.monotonic) has lasted long enough."""
        elapsed = time.monotonic() - started
        remaining = max(self.compute_s, elapsed) * self.slowdown - elapsed
        if remaining > 0:
            time.sleep(remaining)
