"""Credit for streams being received: which of a stream's chunks this node no longer holds,
told back to its sender, which runs at most a window of chunks ahead of that
(``p2p.transport.outbound``).

A chunk is released when the last of its frames is freed, whatever freed it: copied into its
message and dropped (a message taken whole), or mixed in and let go by the reader of a kind
taken piece by piece (``gossip.buffers.pieces``), or dropped unread (a full inbox, a stream
refused). A frame reports its end by a ``weakref.finalize``, on whichever thread lets it go,
so no reader has to hand anything back: what a node holds of a neighbour's stream is what its
reader has not finished with, and a reader that holds a whole next round of pieces (a node a
round behind its neighbour) holds a window of them, the rest waiting in the sender's memory.

Credit goes back on the connection the chunk came over (the sender's DEALER, through this
node's ROUTER; or, to a node that does not listen, its own DEALER), as a ``credit`` message:
the stream's session and first seq and the chunks released so far, so a lost or reordered
credit is made good by the next. Nothing is kept for a stream once all its chunks are released,
or once what came of it is released and nothing more came for ``IDLE_S`` (a sender gone
mid-stream).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from p2p.transport.reassembly import StreamName

CREDIT = "credit"  # the message kind, handled by the transport itself
IDLE_S = 30.0


@dataclass
class _Return:
    """A stream's way back to its sender and what has been released of it."""

    reply: Hashable  # the connection its chunks came over (the transport's to interpret)
    session: int
    first_seq: int
    count: int  # chunks in the stream
    heard: float
    arrived: int = 0
    released: int = 0
    told: int = 0  # released chunks the sender has been told of


class CreditLedger:
    """Per stream being received, the chunks released (see the module docstring); every method
    but :meth:`release` runs on the network thread.

    Args:
        wake: called when a chunk is released on another thread (the network thread then sends
            the credit on its next turn).
    """

    def __init__(self, wake: Callable[[], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._wake = wake
        self._clock = clock
        self._streams: dict[StreamName, _Return] = {}
        self._due: set[StreamName] = set()
        self._lock = threading.RLock()  # (a release may run on any thread, the network thread too)
        self._closed = False

    def hold(self, name: StreamName, count: int, reply: Hashable, frames: Sequence[Any]) -> None:
        """A chunk of stream ``name`` (of ``count`` chunks) came over ``reply`` in ``frames``
        (its payload's): credit it back once they are all freed."""
        with self._lock:
            entry = self._streams.get(name)
            if entry is None:
                entry = self._streams[name] = _Return(reply, name[1], name[2], count, self._clock())
            entry.reply = reply
            entry.heard = self._clock()
            entry.arrived += 1
        if not frames:
            self.release(name)
            return
        left = _Countdown(len(frames), lambda: self.release(name))
        for frame in frames:
            weakref.finalize(frame, left.one)

    def release(self, name: StreamName) -> None:
        """One chunk of ``name`` was freed (any thread)."""
        with self._lock:
            entry = self._streams.get(name)
            if entry is None or self._closed:
                return
            entry.released += 1
            self._due.add(name)
            self._wake()  # (under the lock: never after close)

    def close(self) -> None:
        """No more credit: chunks freed from now on (after the transport closed) are let be."""
        with self._lock:
            self._closed = True
            self._streams.clear()

    def due(self) -> list[tuple[Hashable, dict[str, int]]]:
        """The credits to send now: (the way back, the credit's meta) per stream released from
        since it was last told; a stream all released is forgotten."""
        with self._lock:
            due, self._due = self._due, set()
            credits = []
            for name in due:
                entry = self._streams.get(name)
                if entry is None or entry.released == entry.told:
                    continue
                entry.told = entry.released
                meta = {"session": entry.session, "stream": entry.first_seq, "released": entry.released}
                credits.append((entry.reply, meta))
                if entry.released >= entry.count:
                    del self._streams[name]
            return credits

    def expire(self, now: float) -> None:
        """Forget the streams all released of which nothing more came for ``IDLE_S``."""
        with self._lock:
            idle = [n for n, e in self._streams.items() if e.released == e.arrived and now - e.heard > IDLE_S]
            for name in idle:
                del self._streams[name]
                self._due.discard(name)

    def __len__(self) -> int:
        return len(self._streams)


class _Countdown:
    """Calls ``done`` after ``one`` was called ``count`` times."""

    def __init__(self, count: int, done: Callable[[], None]) -> None:
        self._left, self._done = count, done
        self._lock = threading.Lock()

    def one(self) -> None:
        with self._lock:
            self._left -= 1
            finished = self._left == 0
        if finished:
            self._done()
