"""Where a node's time goes: every gossip round split into phases, on the training thread.

``compute`` is the training loop between two rounds (data, forward, backward, local steps).
Within a round: ``encode`` (choosing the neighbours and preparing what is sent: copies,
compression), ``send`` (queueing messages), ``wait`` (blocked for neighbours' messages),
``decode`` (checking, decompressing and taking in each message as it arrives) and ``mix``
(what follows the last message: averaging into the model).

The algorithms are not touched: the round's calls to the network go through :class:`TimedPeer`,
each call starts a phase, and the time up to the next call belongs to that phase. Calls from
other threads (an asynchronous algorithm's exchanger, serving state to newcomers) are outside
the training thread's rounds and are not timed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from gossip.network import Envelope, PeerNetwork, PeerWrapper

PHASES = ("compute", "encode", "send", "wait", "decode", "mix")


class PhaseTimer:
    """Per-round phase durations (``last``, seconds) and their running totals (``totals``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock  # the network's clock: virtual time in a simulation
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.last: dict[str, float] = {}
        self._current = dict.fromkeys(PHASES, 0.0)
        self._thread: int | None = None  # the thread inside a round, if any
        self._phase = "encode"
        self._since = 0.0
        self._last_end: float | None = None

    @contextmanager
    def round(self) -> Iterator[None]:
        """Time one round (the gossip part of a step); compute is the time since the last one."""
        now = self._clock()
        self._current = dict.fromkeys(PHASES, 0.0)
        if self._last_end is not None:
            self._current["compute"] = now - self._last_end
        self._phase, self._since, self._thread = "encode", now, threading.get_ident()
        try:
            yield
        finally:
            self.enter(self._phase)
            self._thread, self._last_end = None, self._clock()
            self.last = self._current
            for phase, seconds in self._current.items():
                self.totals[phase] += seconds

    def timing(self) -> bool:
        """Whether the calling thread is inside a round."""
        return self._thread == threading.get_ident()

    def enter(self, phase: str) -> None:
        """Close the running phase and start ``phase`` now."""
        now = self._clock()
        self._current[self._phase] += now - self._since
        self._phase, self._since = phase, now


class TimedPeer(PeerWrapper):
    """A ``PeerNetwork`` that tells a :class:`PhaseTimer` which phase each call starts."""

    def __init__(self, peer: PeerNetwork, timer: PhaseTimer) -> None:
        super().__init__(peer)
        self._timer = timer

    def send(
        self,
        to: str,
        kind: str,
        round: int,
        tensors: Sequence[np.ndarray] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        if self._timer.timing():
            self._timer.enter("send")
        self._peer.send(to, kind, round, tensors, meta)

    def recv(self, timeout: float, kinds: Collection[str] | None = None) -> Envelope | None:
        timing = self._timer.timing()
        if timing:
            self._timer.enter("wait")
        message = self._peer.recv(timeout, kinds)
        if timing:
            self._timer.enter("mix" if message is None else "decode")
        return message
