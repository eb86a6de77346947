"""Outgoing connections: one DEALER per (address, CURVE key, lane), bounded in number and closed
when idle. Lane 0 carries every message; with ``--streams K`` (K > 1) a stream of chunks to a
peer goes over lanes 1..K instead, K connections that fill a long link where one TCP stream
cannot. A lane queues only ``LANE_QUEUE`` chunks, and its chunks are handed to the lanes in turn
(``p2p.transport.outbound``): so no lane runs more than a few chunks ahead of the others, however unevenly
the link shares itself among them, and the receiver never holds more than a stream or two of a
sender unfinished.

A connection is named by the address it dials *and* the key it expects there, so learning of
another key for an address (from a beacon, from a member record) opens another connection and
never touches a working one. An address whose key is not known yet (a bootstrap address) is
dialed once per trusted key, of which only the right one completes; such unverified
connections are few (``max_unverified``) and short-lived (``unverified_s``). A handshake the
peer refuses (its trusted folder lacks this node's key) ends that connection for good: ZeroMQ
never redials it. It is closed and dialed again by the next message sent to it, at most once per
``REFUSED_RETRY_S``: a key trusted after its node started (copied in by hand, or half-written
when first read) admits that node's connections within about that.

A message sent on a member's connection that has not come up yet (ZeroMQ would drop it: every
socket has ZMQ_IMMEDIATE) waits for it, up to ``HANDSHAKE_S`` and ``MAX_WAITING`` messages, so the
first messages to a new member are not lost to a busy machine's slow handshake. So does a
``patient`` message to an address not known as a member's (membership's: a join's tables,
which a handshake slowed by a loaded peer would otherwise lose on every try), up to
``MAX_WAITING_UNVERIFIED``; if that connection never comes up (a wrong key among those tried),
its messages go uncounted: their protocol asks again. Others to such an address are dropped
at once.

A node that does not listen (``--no-listen``, address ``inbound://ID``) is reached over the
connections it opened: each message a node's ROUTER receives notes the route back to its
sender (the routing id of the sender's DEALER), and a message to an ``inbound://`` address
goes out on the ROUTER along the sender's latest route (``ZMQ_ROUTER_MANDATORY``: a route
whose connection is gone fails the send, as a dead peer's DEALER does). Routes are bounded
(``MAX_ROUTES``, least recently heard dropped first). On such a node each DEALER is read too.

Every socket counts against ``max_connections`` (kept well below ZeroMQ's 1023 sockets per
context): opening one more closes the least recently used. A connection not sent on for
``idle_s`` is closed; the next send to it dials again. So no peer, however many addresses it
names, can make a node hold more than ``max_connections`` sockets, or hold one for long.
"""

from __future__ import annotations

import errno
import secrets
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from p2p.address import INBOUND, inbound_id
from p2p.security.curve import Curve, configure_client
from p2p.transport.polling import Poller

MAX_CONNECTIONS = 512
MAX_UNVERIFIED = 64  # sockets to addresses whose key is not known (bootstrap, beacon) at once
IDLE_S = 120.0
UNVERIFIED_S = 10.0
REFUSED_RETRY_S = 1.0  # a connection whose handshake was refused is dialed again after this
CONNECT_GRACE_S = 0.05  # a new connection drops what is sent before it is up: dial, then speak
HANDSHAKE_S = 2.0  # what is sent on a new connection waits this long for it to come up...
MAX_WAITING = 32  # ...this many messages per connection
MAX_WAITING_UNVERIFIED = 4  # ...and on a connection to an address not known as a member's
# How long a connection to a peer that went silent (a crashed host, a partition) stays open: the
# kernel closes it, by TCP keepalive probes once it is idle for KEEPALIVE_IDLE_S and by the time
# sent data may go unacknowledged (TCP_USER_TIMEOUT). Not seconds: on a congested link one of
# several TCP connections can stall for seconds in retransmission backoff, and a short timeout
# drops connections mid-stream on slow or shared links. A crashed peer's connection closes at
# once anyway (its host resets it); membership's probes find dead members in seconds. Not
# ZeroMQ's heartbeats: their timer writes on a connection whose input stopped (a full receive
# queue) after its peer reset it, and libzmq 4.3.5 aborts the process (`!_io_error`, as in
# zeromq/libzmq#3937 and #4767); and they close a healthy connection whose input is held back,
# its pings unread.
SILENT_TIMEOUT_S = 30
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
MAX_ROUTES = MAX_CONNECTIONS  # routes back to senders that may not listen

Target = tuple[str, bytes, int]  # (address, server key, lane); the key is b"" without CURVE
MAX_LANES = 17  # lane 0, and up to 16 for streams
LANE_QUEUE = 2  # chunks queued on a stream lane (ZMQ_SNDHWM)


@dataclass
class Connection:
    socket: zmq.Socket[bytes]
    opened: float
    used: float
    verified: bool  # its key came from a member record (or CURVE is off)
    waiting: deque[list[Any]] = field(default_factory=deque)  # messages sent before it was up
    up: bool = False  # a message went out on it (then a failed send means the peer is gone)
    routed: bool = False  # to an inbound:// address, over the ROUTER...
    route: bytes | None = None  # ...along this routing id (None: none heard yet)
    # CURVE: the peer's ZAP handler refusing this node's key reaches a client only as an event
    monitor: zmq.Socket[bytes] | None = None
    refused_at: float | None = None  # when the peer refused its handshake (then it is dead)

    def send(self, frames: list[Any]) -> None:
        """Send without blocking: ``zmq.Again`` when the peer's queue is full (or a route is
        not known yet), :class:`RouteClosedError` when a route's connection has closed."""
        if not self.routed:
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return
        if self.route is None:
            raise zmq.Again
        try:
            self.socket.send_multipart([self.route, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                raise RouteClosedError from None
            raise


class RouteClosedError(Exception):
    """The connection a route went back over has closed (its peer left or reconnected)."""


class Connections:
    """The DEALERs of one transport; network thread only.

    Args:
        context: the transport's ZeroMQ context.
        node_id: each DEALER's routing id is ``NODE_ID/TOKEN``, a random token per connection:
            a receiver reads the id a sender claims from it, and no connection, a new one of
            the same node after a partition or one of an impostor, ever collides with another
            at the receiving ROUTER; that ROUTER hands an id in use over to the connection
            that claims it, which only the DEALER that held it does, reconnecting after its
            connection dropped.
        curve: keys for CURVE, None without.
        send_queue: ZMQ_SNDHWM of each socket.
        linger_ms: ZMQ_LINGER of each socket (on idle or evicted close: 0).
        on_close: called with a target whose socket was closed (its queued stream is gone).
        poller: the network thread's; with ``receives``, every DEALER is read (this node does
            not listen: what its peers send it comes back on the connections it opened).
    """

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        *,
        node_id: str,
        curve: Curve | None,
        send_queue: int,
        linger_ms: int,
        on_close: Callable[[Target, Connection], None],
        poller: Poller,
        receives: bool = False,
        max_connections: int = MAX_CONNECTIONS,
        max_unverified: int = MAX_UNVERIFIED,
        idle_s: float | None = None,
        unverified_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._context = context
        self._node_id = node_id
        self._curve = curve
        self._send_queue = send_queue
        self._linger_ms = linger_ms
        self._on_close = on_close
        self._poller = poller
        self._receives = receives
        self.router: zmq.Socket[bytes] | None = None  # the transport's, once bound
        self._routes: OrderedDict[tuple[str, str], bytes] = OrderedDict()  # (id, key) -> routing id
        self._max = max_connections
        self._max_unverified = max_unverified
        self._idle_s = IDLE_S if idle_s is None else idle_s
        self._unverified_s = UNVERIFIED_S if unverified_s is None else unverified_s
        self._clock = clock
        self._open: OrderedDict[Target, Connection] = OrderedDict()  # least recently used first
        self.evicted = 0
        self.refused: Counter[str] = Counter()  # handshakes refused for this node's key, by address
        self._monitored: dict[zmq.Socket[bytes], Target] = {}  # a DEALER's monitor -> its target

    def __len__(self) -> int:
        return len(self._open)

    def note_route(self, node_id: str, key: str, routing_id: bytes) -> None:
        """A message from ``node_id`` (under CURVE ``key``) came over ``routing_id``: the way
        back to it if it does not listen."""
        self._routes[node_id, key] = routing_id
        self._routes.move_to_end((node_id, key))
        if len(self._routes) > MAX_ROUTES:
            self._routes.popitem(last=False)

    def targets(self, address: str, key: str | None) -> list[Target]:
        """Where a message to ``address`` goes: the one (address, key), or with CURVE and no key
        known, one per trusted key (to an ``inbound://`` address, per key it was heard under);
        none for a key that is not trusted."""
        if self._curve is None:
            return [(address, b"", 0)]
        node_id = inbound_id(address)
        if key is None and node_id is not None:
            return [(address, k.encode(), 0) for n, k in self._routes if n == node_id]
        if key is None:
            return [(address, k, 0) for k in sorted(self._curve.trusted.current())]
        raw = key.encode()
        return [(address, raw, 0)] if self._curve.trusted.allows(raw) else []

    def get(self, target: Target, *, verified: bool) -> Connection | None:
        """The connection to ``target``, dialed now if there is none or its handshake was
        refused ``REFUSED_RETRY_S`` ago (None: an ``inbound://`` target that is not a member's,
        with no route back); marks it used. A member's messages to an ``inbound://`` target
        wait for its route as they wait for a handshake."""
        now = self._clock()
        connection = self.find(target)
        refused_at = connection.refused_at if connection is not None else None
        if refused_at is not None and now - refused_at >= REFUSED_RETRY_S:
            self._close(target, linger_ms=0)
            connection = None
        if connection is None and inbound_id(target[0]) is not None:
            connection = self._routed(target, verified, now)
            if connection is None:
                return None
        if connection is None:
            connection = self._dial(target, verified, now)
        else:
            self._open.move_to_end(target)
            connection.verified |= verified
        connection.used = now
        return connection

    def send(self, target: Target, frames: list[Any], *, verified: bool, patient: bool = False) -> bool:
        """Send on the connection to ``target`` (dialed now if there is none) without blocking;
        False when the message is dropped (a connection that is up but full, or none). On a
        connection still in its handshake a member's message waits for it, and a ``patient``
        one (see above)."""
        connection = self.get(target, verified=verified)
        if connection is None:
            return False
        if not connection.waiting:
            try:
                connection.send(frames)
                connection.up = True
                return True
            except zmq.Again:
                pass
            except RouteClosedError:
                self.forget_route(target)
                return False
        young = self._clock() - connection.opened < HANDSHAKE_S
        room = MAX_WAITING if connection.verified else MAX_WAITING_UNVERIFIED if patient else 0
        if not connection.up and young and len(connection.waiting) < room:
            connection.waiting.append(frames)
            return True
        return False

    @property
    def waiting(self) -> bool:
        """Whether messages wait for a connection to come up (then call :meth:`flush` soon)."""
        return any(c.waiting for c in self._open.values())

    def flush(self) -> int:
        """Send what waits on connections that came up; returns how many messages were dropped
        because theirs did not within ``HANDSHAKE_S``."""
        dropped, now = 0, self._clock()
        for target, connection in self._open.items():
            if connection.routed and connection.waiting:
                connection.route = self._routes.get(_route_key(target))
            while connection.waiting:
                try:
                    connection.send(connection.waiting[0])
                except (zmq.Again, RouteClosedError) as exc:
                    if isinstance(exc, RouteClosedError):  # a stale route: wait for a new one
                        self._routes.pop(_route_key(target), None)
                    if now - connection.opened >= HANDSHAKE_S:
                        dropped += len(connection.waiting) if connection.verified else 0
                        connection.waiting.clear()
                    break
                connection.waiting.popleft()
                connection.up = True
        return dropped

    def find(self, target: Target) -> Connection | None:
        """The open connection to ``target`` (a routed one along its latest route), if any."""
        connection = self._open.get(target)
        if connection is not None and connection.routed:
            connection.route = self._routes.get(_route_key(target))
        return connection

    def readable(self, events: dict[Any, int]) -> list[tuple[Target, Connection]]:
        """The DEALERs that have input (where they are read: see ``receives``). A routed
        connection's socket is the ROUTER, which the transport reads on its own: what it holds
        is not that connection's."""
        if not self._receives:
            return []
        return [
            (t, c) for t, c in self._open.items() if not c.routed and events.get(c.socket, 0) & zmq.POLLIN
        ]

    def read_refusals(self, events: dict[Any, int]) -> None:
        """Count the handshakes that peers refused for this node's key (their --trusted lacks
        it), and mark their connections for redialing."""
        for socket in events:
            target = self._monitored.get(socket)
            while target is not None:
                try:
                    event = recv_monitor_message(socket, flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    self.refused[target[0]] += 1
                    self._open[target].refused_at = self._clock()

    def forget_route(self, target: Target) -> None:
        """The route to an ``inbound://`` target failed: its connection has closed."""
        if inbound_id(target[0]) is not None:
            self._routes.pop(_route_key(target), None)
        if target in self._open:
            self._close(target, linger_ms=0)

    def close_address(self, address: str) -> None:
        """Close every connection to ``address`` (whatever key), dropping what is queued."""
        for target in [t for t in self._open if t[0] == address]:
            self._close(target, linger_ms=0)

    def expire(self, now: float) -> None:
        """Close the connections idle for too long."""
        for target, connection in list(self._open.items()):
            limit = self._idle_s if connection.verified else min(self._idle_s, self._unverified_s)
            if now - connection.used > limit:
                self._close(target, linger_ms=0)

    def close_all(self) -> None:
        for target in list(self._open):
            self._close(target, linger_ms=self._linger_ms)

    def _routed(self, target: Target, verified: bool, now: float) -> Connection | None:
        """A new connection to an ``inbound://`` target along its latest route (for a member's
        messages, also before one is known), or None."""
        route = self._routes.get(_route_key(target))
        if self.router is None or (route is None and not verified):
            return None
        if len(self._open) >= self._max:
            self._evict(next(iter(self._open)))
        connection = Connection(
            self.router, now, now, verified, up=route is not None, routed=True, route=route
        )
        self._open[target] = connection
        return connection

    def _dial(self, target: Target, verified: bool, now: float) -> Connection:
        if not verified:
            unverified = [t for t, c in self._open.items() if not c.verified]
            if len(unverified) >= self._max_unverified:
                self._evict(unverified[0])
        if len(self._open) >= self._max:
            self._evict(next(iter(self._open)))
        address, key, lane = target
        socket = self._context.socket(zmq.DEALER)
        monitor = None
        if self._curve is not None:
            configure_client(socket, self._curve.keys, key)
            monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            self._monitored[monitor] = target
            self._poller.want(monitor, zmq.POLLIN)
        lane_suffix = f"/{lane}" if lane else ""  # (the receiver keeps each lane's seqs apart)
        socket.setsockopt(zmq.ROUTING_ID, f"{self._node_id}/{secrets.token_hex(8)}{lane_suffix}".encode())
        socket.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a live connection: a dead peer drops
        close_when_silent(socket)  # (then the DEALER dials again)
        socket.setsockopt(zmq.SNDHWM, LANE_QUEUE if lane else self._send_queue)
        socket.setsockopt(zmq.LINGER, self._linger_ms)
        connection = Connection(socket, now, now, verified, monitor=monitor)
        try:
            socket.connect(address)
        except zmq.ZMQError:  # an address ZeroMQ cannot dial: no socket is left behind
            self._close_sockets(connection, linger_ms=0)
            raise
        self._open[target] = connection
        if self._receives:
            self._poller.want(socket, zmq.POLLIN)
        return connection

    def _evict(self, target: Target) -> None:
        self.evicted += 1
        self._close(target, linger_ms=0)

    def _close(self, target: Target, *, linger_ms: int) -> None:
        connection = self._open.pop(target)
        self._on_close(target, connection)
        if not connection.routed:  # (a route's socket is the ROUTER: it stays)
            self._close_sockets(connection, linger_ms=linger_ms)

    def _close_sockets(self, connection: Connection, *, linger_ms: int) -> None:
        self._poller.unwant(connection.socket, zmq.POLLIN | zmq.POLLOUT)
        if connection.monitor is not None:
            del self._monitored[connection.monitor]
            self._poller.unwant(connection.monitor, zmq.POLLIN)
            connection.socket.disable_monitor()
            connection.monitor.close(linger=0)
        connection.socket.close(linger=linger_ms)


def close_when_silent(socket: zmq.Socket[bytes]) -> None:
    """Have the kernel close ``socket``'s connections to a peer silent for ``SILENT_TIMEOUT_S``."""
    socket.setsockopt(zmq.TCP_KEEPALIVE, 1)
    socket.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    socket.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
    socket.setsockopt(zmq.TCP_KEEPALIVE_CNT, (SILENT_TIMEOUT_S - KEEPALIVE_IDLE_S) // KEEPALIVE_INTERVAL_S)
    socket.setsockopt(zmq.TCP_MAXRT, SILENT_TIMEOUT_S * 1000)  # (TCP_USER_TIMEOUT: unacknowledged data)


def _route_key(target: Target) -> tuple[str, str]:
    """The (node id, key) a route to an ``inbound://`` target is kept under."""
    return target[0].removeprefix(INBOUND), target[1].decode()


def usable_at(connection: Connection) -> float:
    """When a connection can be sent on without its first messages being dropped."""
    return connection.opened + CONNECT_GRACE_S
