"""Self-tuning local steps (``average_every="auto"``): H chosen from what
the nodes measure, one H for the whole mesh per epoch of rounds (``gossip.tuning.agreement``).

Each node measures the compute time of its local steps and the time a gossip round keeps it
from computing (sending, waiting for its neighbours' values, mixing), and proposes the H at
which rounds take at most :data:`COMM_SHARE` of its time: ``H = (1 - s) / s * round / step``,
within [1, :data:`MAX_H`] (from ``gossip.optim.outer.MIN_LOCAL_STEPS`` with DiLoCo's outer step). So
a slow link, a large model or a slow neighbour raises H and a fast link lowers it again,
re-chosen every epoch; the mesh takes the largest proposal. Where neighbours differ in H for an
epoch, rounds still pair by number: that costs waiting, not correctness.

A round's cost is only visible where the round mixes what it waits for: ``adpsgd`` and
``overlap`` hide it, and are refused with ``auto``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from gossip.tuning.agreement import COMM_SHARE, RECENT, EpochAgreement

MAX_H = 256


class PeriodAgreement(EpochAgreement):
    """One node's side: its measurements and the H its proposals call for (``value_for(round)``
    is the H before ``round``)."""

    meta_key = "period"

    def __init__(self, min_h: int = 1) -> None:
        super().__init__(floor=min_h, cap=MAX_H, start=min_h)
        self._step_s: deque[float] = deque(maxlen=RECENT)
        self._round_s: deque[float] = deque(maxlen=RECENT)

    def observe(self, *, step_s: float | None = None, round_s: float | None = None) -> None:
        """A local step's compute time, or a round's, in seconds."""
        if step_s is not None:
            self._step_s.append(step_s)
        if round_s is not None:
            self._round_s.append(round_s)

    def proposal(self) -> int | None:
        """The H this node's measurements call for (None before it has measured both)."""
        if not self._step_s or not self._round_s:
            return None
        step, round_ = statistics.median(self._step_s), statistics.median(self._round_s)
        return math.ceil((1 - COMM_SHARE) / COMM_SHARE * round_ / max(step, 1e-6))
