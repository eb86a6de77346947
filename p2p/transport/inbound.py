"""Inbound TCP connections counted and capped, so that a stranger's flood of idle connections
cannot use up the node's file descriptors (and with them its ticks and its peers' messages).

A ROUTER accepts connections by itself; its monitor socket tells of each (``EVENT_ACCEPTED``,
with the connection's file descriptor) and of each that ends (``EVENT_DISCONNECTED``). A
connection beyond :data:`MAX_INBOUND` in all (at most half the process's descriptor limit) or
:data:`MAX_INBOUND_PER_ADDRESS` from one source address is shut down at once (``shutdown`` on
a duplicate of the descriptor: ZeroMQ sees the connection end and closes its own), counted in
``refused``. A connection that has not finished its CURVE handshake within
:data:`HANDSHAKE_MS` is closed by ZeroMQ (``ZMQ_HANDSHAKE_IVL``), and handshakes in flight are
capped on their own: at most :data:`MAX_HANDSHAKES` in all and :data:`MAX_HANDSHAKES_PER_ADDRESS`
from one address, so that a stranger's half-open handshakes (each holding the server's side of
a CURVE exchange) cannot take every place. A connection counts as in its handshake from its
acceptance until its first message arrives (the network thread calls :meth:`InboundGuard.heard`
with the message's descriptor), it ends, or :data:`HANDSHAKE_MS` has passed (ZeroMQ has closed
it by then unless its handshake succeeded): at most that, never less.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import time
from collections import Counter

import zmq
from zmq.utils.monitor import recv_monitor_message

from p2p.security.ratelimit import QuietLog

MAX_INBOUND = 1024  # connections accepted at once (and at most half the descriptor limit)
MAX_INBOUND_PER_ADDRESS = 256  # from one source address (a host of many nodes, each with lanes)
HANDSHAKE_MS = 10_000  # an inbound connection that is not authenticated by then is closed
MAX_HANDSHAKES = 128  # inbound connections in their handshake at once...
MAX_HANDSHAKES_PER_ADDRESS = 64  # ...and from one source address (a host's nodes starting at once)
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
log = logging.getLogger(__name__)


class InboundGuard:
    """The caps on a bound ROUTER's inbound connections (see the module docstring)."""

    def __init__(self, router: zmq.Socket[bytes]) -> None:
        self.port = int(router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.monitor = router.get_monitor_socket(_EVENTS)
        self.limit = min(MAX_INBOUND, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2)
        self.refused: Counter[str] = Counter()  # connections shut down, by reason
        self._open: dict[int, str] = {}  # file descriptor -> source address
        self._per_address: Counter[str] = Counter()
        self._handshaking: dict[int, float] = {}  # descriptor -> when accepted, until its first message
        self._router = router
        self._log = QuietLog(log)

    @property
    def open(self) -> int:
        """Inbound connections open now."""
        return len(self._open)

    @property
    def handshaking(self) -> int:
        """Inbound connections in their handshake now (at most; see the module docstring)."""
        self._expire(time.monotonic())
        return len(self._handshaking)

    def heard(self, frame: zmq.Frame) -> None:
        """A message arrived in ``frame``: its connection's handshake is over."""
        if self._handshaking:
            self._handshaking.pop(int(frame.get(zmq.SRCFD)), None)

    def drain(self) -> None:
        """Take every event the monitor holds."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
            else:
                self._gone(fd)

    def close(self) -> None:
        self._router.disable_monitor()
        self.monitor.close(linger=0)

    def _accepted(self, fd: int) -> None:
        source = _source_of(fd, self.port)
        if source is None:  # (gone already, its descriptor reused by another kind of socket)
            return
        now = time.monotonic()
        self._expire(now)
        if len(self._open) >= self.limit:
            reason = "too_many_connections"
        elif self._per_address[source] >= MAX_INBOUND_PER_ADDRESS:
            reason = "too_many_from_address"
        elif len(self._handshaking) >= MAX_HANDSHAKES:
            reason = "too_many_handshakes"
        elif sum(self._open[h] == source for h in self._handshaking) >= MAX_HANDSHAKES_PER_ADDRESS:
            reason = "too_many_handshakes_from_address"
        else:
            self._open[fd] = source
            self._per_address[source] += 1
            self._handshaking[fd] = now
            return
        self.refused[reason] += 1
        self._log.warning(reason, "refused an inbound connection from %s: %s", source, reason)
        _shut(fd)

    def _expire(self, now: float) -> None:
        """Forget the handshakes older than ``HANDSHAKE_MS``: over, one way or the other."""
        for fd, accepted in list(self._handshaking.items()):
            if now - accepted < HANDSHAKE_MS / 1000:
                break  # (in order of acceptance)
            del self._handshaking[fd]

    def _gone(self, fd: int) -> None:
        self._handshaking.pop(fd, None)
        source = self._open.pop(fd, None)
        if source is not None:
            self._per_address[source] -= 1
            if not self._per_address[source]:
                del self._per_address[source]


def _source_of(fd: int, port: int) -> str | None:
    """The source address of the inbound TCP connection ``fd``; None unless ``fd`` is one
    accepted on ``port``."""
    try:
        with socket.socket(fileno=os.dup(fd)) as connection:
            inet = connection.family in (socket.AF_INET, socket.AF_INET6)
            if not inet or connection.type != socket.SOCK_STREAM or connection.getsockname()[1] != port:
                return None
            return str(connection.getpeername()[0])
    except OSError:
        return None


def _shut(fd: int) -> None:
    """End the connection ``fd`` without closing the descriptor ZeroMQ owns."""
    try:
        with socket.socket(fileno=os.dup(fd)) as connection:
            connection.shutdown(socket.SHUT_RDWR)
    except OSError:  # (it ended meanwhile)
        pass
