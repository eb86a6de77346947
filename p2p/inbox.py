"""A bounded, thread-safe inbox that readers filter by message kind."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Collection

from p2p.wire import Message


class Inbox:
    """Messages wait here for the thread that reads their kind.

    A reader takes the oldest message of the kinds it asks for and leaves the others for their
    own readers; :meth:`notify` makes every blocked reader return None (the membership changed:
    re-read it). When full, the oldest message is dropped and :meth:`put` says so.
    """

    def __init__(self, maxlen: int = 4096) -> None:
        self._messages: deque[Message] = deque(maxlen=maxlen)
        self._ready = threading.Condition()
        self._wakeups = 0

    def put(self, message: Message) -> bool:
        """Add a message; False when the oldest one had to be dropped to make room."""
        with self._ready:
            full = len(self._messages) == self._messages.maxlen
            self._messages.append(message)
            self._ready.notify_all()
        return not full

    def get(self, timeout: float, kinds: Collection[str] | None = None) -> Message | None:
        """The oldest message of ``kinds`` (any kind if None), or None after ``timeout`` s or a
        :meth:`notify`."""
        deadline = time.monotonic() + timeout
        with self._ready:
            wakeups = self._wakeups
            while True:
                for index, message in enumerate(self._messages):
                    if kinds is None or message.kind in kinds:
                        del self._messages[index]
                        return message
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._wakeups != wakeups:
                    return None
                self._ready.wait(remaining)

    def notify(self) -> None:
        with self._ready:
            self._wakeups += 1
            self._ready.notify_all()
