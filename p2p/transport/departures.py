"""Which of the messages a node sent to each peer have not left it yet.

A message with tensors is on its way out from the moment it is sent until ZeroMQ releases its
last frame: written to the kernel's socket buffer, or dropped and freed (a full or closed
connection, a send cap's backlog). Its last frame is a ZeroMQ frame that reports when that
happens (``zmq.Frame(track=True)``), so no thread polls anything. What it lets an algorithm do:
hold back a model rather than queue it behind a link that carries less than the algorithm
sends, where each queued model would arrive older than the last (``PeerNetwork.backlog``).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import zmq


class Departure:
    """One message on its way out: waiting to be encoded (under a send cap), then in ZeroMQ."""

    __slots__ = ("_gone", "_trackers")

    def __init__(self) -> None:
        self._trackers: list[zmq.MessageTracker] = []
        self._gone = False

    @property
    def left(self) -> bool:
        return self._gone or (bool(self._trackers) and all(t.done for t in self._trackers))

    def track(self, frames: list[Any]) -> None:
        """Replace the last frame of a message (or of each of a stream's last chunks, one per
        connection it is spread over) with one that reports when ZeroMQ releases it."""
        frame = zmq.Frame(frames[-1], copy=False, track=True)
        frames[-1] = frame
        self._trackers.append(frame.tracker)

    def gone(self) -> None:
        """The message was dropped before it was encoded."""
        self._gone = True


class Departures:
    """Per peer address, the messages on their way out (any thread)."""

    def __init__(self) -> None:
        self._leaving: dict[str, deque[Departure]] = {}
        self._lock = threading.Lock()

    def start(self, address: str) -> Departure:
        departure = Departure()
        with self._lock:
            self._prune(address)
            self._leaving.setdefault(address, deque()).append(departure)
        return departure

    def count(self, address: str) -> int:
        """Messages to ``address`` that have not left yet."""
        with self._lock:
            self._prune(address)
            return sum(not d.left for d in self._leaving.get(address, ()))

    def _prune(self, address: str) -> None:
        """Forget the oldest departures that have left (messages leave a connection in order)."""
        leaving = self._leaving.get(address)
        if leaving is None:
            return
        while leaving and leaving[0].left:
            leaving.popleft()
        if not leaving:
            del self._leaving[address]
