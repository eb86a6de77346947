"""A bounded, thread-safe inbox that readers filter by message kind."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Collection

from p2p.wire import Message


class Inbox:
    """Messages wait here for the thread that reads their kind.

    A reader takes the oldest message of the kinds it asks for and leaves the others for their
    own readers; :meth:`notify` makes every blocked reader return None (the membership changed:
    re-read it). Each (kind, sender) has its own queue of at most ``per_sender`` messages, and
    all of them together hold at most ``maxlen``: a sender that floods loses its own oldest
    messages (or, when the inbox is full, the sender with the longest queue does), never the
    one message another sender has waiting. :meth:`put` says when a message had to go.
    """

    def __init__(self, maxlen: int = 4096, per_sender: int | None = None) -> None:
        self._maxlen = maxlen
        self._per_sender = per_sender or maxlen
        self._queues: dict[tuple[str, str], deque[tuple[int, Message]]] = {}
        self._count = 0
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._wakeups = 0

    def put(self, message: Message) -> bool:
        """Add a message; False when an older one had to be dropped to make room."""
        with self._ready:
            key = (message.kind, message.sender)
            queue = self._queues.setdefault(key, deque())
            full = len(queue) >= self._per_sender or self._count >= self._maxlen
            if full:
                victim = key if len(queue) >= self._per_sender else max(self._queues, key=self._length)
                self._queues[victim].popleft()
                self._count -= 1
                if victim != key and not self._queues[victim]:
                    del self._queues[victim]
            queue.append((next(self._order), message))
            self._count += 1
            self._ready.notify_all()
        return not full

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
                    _, key = min(heads)
                    queue = self._queues[key]
                    _, message = queue.popleft()
                    self._count -= 1
                    if not queue:
                        del self._queues[key]
                    return message
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

    def _length(self, key: tuple[str, str]) -> int:
        return len(self._queues[key])
