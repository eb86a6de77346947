"""A bounded, thread-safe inbox that readers filter by message kind."""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections import deque
from collections.abc import Collection

from p2p.wire import Message


class Inbox:
    """Messages wait here for the thread that reads their kind.

    A reader takes the oldest message of the kinds it asks for and leaves the others for their
    own readers; :meth:`notify` makes every blocked reader return None (the membership changed:
    re-read it). Each (kind, sender) has its own queue of at most ``per_sender`` messages and
    ``per_sender_bytes`` tensor bytes, and all of them together hold at most ``maxlen``
    messages and ``max_bytes``: a sender that floods loses its own oldest messages (or, when
    the inbox is full, the sender with the most bytes waiting does), never the one message
    another sender has waiting. :meth:`put` says when a message had to go.
    """

    def __init__(
        self,
        maxlen: int = 4096,
        per_sender: int | None = None,
        *,
        max_bytes: int | None = None,
        per_sender_bytes: int | None = None,
    ) -> None:
        self._maxlen = maxlen
        self._per_sender = per_sender or maxlen
        self._max_bytes = max_bytes or sys.maxsize
        self._per_sender_bytes = per_sender_bytes or self._max_bytes
        self._queues: dict[tuple[str, str], deque[tuple[int, Message]]] = {}
        self._bytes: dict[tuple[str, str], int] = {}  # tensor bytes waiting per queue
        self._count = 0
        self._total_bytes = 0
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._wakeups = 0

    def put(self, message: Message) -> bool:
        """Add a message; False when an older one had to be dropped to make room."""
        size = _size(message)
        key = (message.kind, message.sender)
        dropped = False
        with self._ready:
            while self._queues.get(key) and (
                len(self._queues[key]) >= self._per_sender or self._bytes[key] + size > self._per_sender_bytes
            ):
                self._pop(key)
                dropped = True
            while self._queues and (
                self._count >= self._maxlen or self._total_bytes + size > self._max_bytes
            ):
                self._pop(max(self._queues, key=self._weight))
                dropped = True
            self._queues.setdefault(key, deque()).append((next(self._order), message))
            self._bytes[key] = self._bytes.get(key, 0) + size
            self._count += 1
            self._total_bytes += size
            self._ready.notify_all()
        return not dropped

    def get(self, timeout: float, kinds: Collection[str] | None = None) -> Message | None:
        """The oldest message of ``kinds`` (any kind if None), or None after ``timeout`` s or a
        :meth:`notify`."""
        deadline = time.monotonic() + timeout
        with self._ready:
            wakeups = self._wakeups
            while True:
                heads = [
                    (queue[0][0], key)
                    for key, queue in self._queues.items()
                    if queue and (kinds is None or key[0] in kinds)
                ]
                if heads:
                    return self._pop(min(heads)[1])
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._wakeups != wakeups:
                    return None
                self._ready.wait(remaining)

    def notify(self) -> None:
        with self._ready:
            self._wakeups += 1
            self._ready.notify_all()

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Tensor bytes waiting, all queues together."""
        return self._total_bytes

    def _pop(self, key: tuple[str, str]) -> Message:
        """Take the oldest message of queue ``key`` (which holds one), forgetting an emptied queue."""
        queue = self._queues[key]
        _, message = queue.popleft()
        size = _size(message)
        self._count -= 1
        self._total_bytes -= size
        self._bytes[key] -= size
        if not queue:
            del self._queues[key], self._bytes[key]
        return message

    def _weight(self, key: tuple[str, str]) -> tuple[int, int]:
        """Which queue loses first when the inbox is full: the most bytes, then the longest."""
        return self._bytes[key], len(self._queues[key])


def _size(message: Message) -> int:
    return sum(int(tensor.nbytes) for tensor in message.tensors)
