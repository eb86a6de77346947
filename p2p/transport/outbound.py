"""What a node sends, on its network thread: whole messages at once, streams of chunks as each
peer's socket takes them (``ZMQ_SNDHWM``) and its receiver grants credit for them, everything
under the send cap when there is one (``p2p.transport.send_cap``).

A stream runs at most a window of chunks (``window_chunks``) ahead of what its receiver has
released (``p2p.transport.credits``): the rest of the payload waits in the sender's memory, where
it is anyway, rather than in the receiver's, which would otherwise hold every chunk that came
before its reader wanted it (a neighbour's model for the next round, one per neighbour). A
stream that gets no credit for ``CREDIT_WAIT_S`` is dropped (its receiver keeps what came).

Per peer, streams go one after the other, each in order (a receiver takes only increasing
sequence numbers, counted apart for chunks and for whole messages: ``p2p.security.identities``);
whole messages do not wait behind a stream, so a stream held back for credit delays no
membership message. A stream waits for the messages queued while its connection came up;
under a cap, messages wait in one queue and streams pause between chunks, paused streams going
first, in turn. Every queue is bounded (``MAX_QUEUED``, ``MAX_STREAMS_PER_PEER``): past it the
oldest is dropped and counted. A stream to a node that does not listen goes over the ROUTER,
which cannot be polled for one peer's room: it is retried every turn of the thread instead.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from p2p.transport.connections import Connection, Connections, RouteClosedError, Target
from p2p.transport.departures import Departure
from p2p.transport.polling import Poller
from p2p.transport.send_cap import SendPacer
from p2p.transport.stats import TransportStats

MAX_STREAMS_PER_PEER = 4  # streams queued to one peer; beyond, the oldest unfinished one is dropped
MAX_QUEUED = 64  # messages waiting for the send cap (as ZMQ_SNDHWM)
WINDOW_BYTES = 8 << 20  # a stream's bytes sent ahead of its receiver's credit (in whole chunks)
CREDIT_WAIT_S = 60.0  # a stream that gets no credit for this long is dropped


class Outbound:
    """Args:
    connections: the node's connections.
    poller: the network thread's poller (a stream waiting for room polls its socket for output).
    stats: counted into: bytes and messages sent, what was dropped.
    pacer: the send cap, or None.
    guarded: runs a send in the transport's error scope.
    unreachable: called with an address no message could be queued to.
    lanes: connections a stream is spread over (``p2p.transport.connections``).
    window_chunks: chunks a stream may run ahead of its receiver's credit.
    """

    def __init__(
        self,
        connections: Connections,
        poller: Poller,
        stats: TransportStats,
        pacer: SendPacer | None,
        guarded: Callable[[str, Callable[[], None]], None],
        unreachable: Callable[[str], None],
        lanes: int = 1,
        window_chunks: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connections, self._poller, self._stats, self._pacer = connections, poller, stats, pacer
        self._guarded, self._unreachable, self._lanes = guarded, unreachable, lanes
        self._window, self._clock = window_chunks, clock
        self._streams: dict[Target, deque[_Queued]] = {}  # per peer: its streams, in order
        self._by_first: dict[int, Target] = {}  # a stream's first seq -> its peer (for credit)
        # sends waiting for the pacer, with what tracks their message's way out
        self._held: deque[tuple[Callable[[], None], Departure | None]] = deque()
        self._paused: dict[Target, None] = {}  # streams waiting for the pacer, in turn
        self._retry: dict[Target, None] = {}  # routed streams waiting for room, tried every turn

    @property
    def paced(self) -> bool:
        return self._pacer is not None

    @property
    def retrying(self) -> bool:
        """Whether routed streams wait for room (then call :meth:`retry` soon)."""
        return bool(self._retry)

    def retry(self) -> None:
        """Feed the routed streams that waited for room."""
        for target in list(self._retry):
            del self._retry[target]
            self.feed(target)

    def due_ms(self) -> int | None:
        """When what waits for the pacer may go (None: nothing waits)."""
        if self._pacer is None or not (self._held or self._paused):
            return None
        return math.ceil(self._pacer.wait_s() * 1000)

    def hold(self, send: Callable[[], None], departure: Departure | None = None) -> None:
        """Run ``send`` in its turn under the cap (it encodes as it leaves, see the transport);
        beyond ``MAX_QUEUED`` waiting, the oldest is dropped (a cap slower than what the node
        makes must not grow its memory or its messages' age without bound) and its
        ``departure`` ends."""
        if len(self._held) >= MAX_QUEUED:
            _, dropped = self._held.popleft()
            if dropped is not None:
                dropped.gone()
            self._stats.drop("send_cap_backlog")
        self._held.append((send, departure))
        self.release()

    def release(self) -> None:
        """What waited for the pacer and may go now: paused streams first (in turn: a stream
        that pauses again goes to the back), then held sends."""
        pacer = self._pacer
        if pacer is None:
            return
        while self._paused and pacer.wait_s() == 0:
            target = next(iter(self._paused))
            del self._paused[target]
            self.feed(target)
        while self._held and pacer.wait_s() == 0:
            send, _ = self._held.popleft()
            self._guarded("command", send)

    def send_now(
        self, address: str, key: str | None, member: bool, frames: list[Any], *, patient: bool = False
    ) -> None:
        targets = self._connections.targets(address, key)
        sent = sum(
            self._connections.send(target, frames, verified=member, patient=patient) for target in targets
        )
        if not targets:
            self._stats.drop("untrusted_key")
        elif not sent:
            self._stats.drop("peer_unreachable_or_full")
            self._unreachable(address)
        else:
            self._stats.messages_sent += 1
            self._count_sent(sum(_nbytes(f) for f in frames))

    def send_stream(
        self, address: str, key: str | None, member: bool, chunks: list[list[Any]], first_seq: int
    ) -> None:
        """Queue a stream (its chunks' frames; ``first_seq``: the seq of its chunk 0, which its
        receiver's credit names it by)."""
        targets = self._connections.targets(address, key)
        if len(targets) != 1:  # CURVE, and the peer's key not known (or not trusted)
            self._stats.drop("peer_key_unknown")
            return
        (target,) = targets
        connection = self._connections.get(target, verified=member)
        if connection is None:
            self._stats.drop("peer_unreachable_or_full")
            self._unreachable(address)
            return
        lanes = [0] if connection.routed or self._lanes == 1 else list(range(1, self._lanes + 1))
        for lane in lanes:
            self._connections.get(_lane(target, lane), verified=member)
        queued = self._streams.setdefault(target, deque())
        if len(queued) >= MAX_STREAMS_PER_PEER:
            self._forget(queued.popleft())  # its receiver keeps what it had of it
            self._stats.drop("stream_backlog")
        chunk_lanes = deque((lanes[i % len(lanes)], chunk) for i, chunk in enumerate(chunks))
        queued.append(_Queued(chunk_lanes, first_seq, key=target[1]))
        self._by_first[first_seq] = target
        self.feed(target)

    def credit(self, first_seq: int, released: int, key: str) -> None:
        """The receiver of stream ``first_seq`` (under CURVE ``key``; "" without) released
        ``released`` of its chunks: the stream may run that many more. A credit for no stream
        being sent to a node of that key (a late one, or a stranger's) changes nothing."""
        target = self._by_first.get(first_seq)
        if target is None:
            return
        queued = next((q for q in self._streams.get(target, ()) if q.first_seq == first_seq), None)
        if queued is None or (queued.key and queued.key.decode() != key):
            return
        queued.credited = max(queued.credited, released)
        if queued is self._streams[target][0] and queued.waiting_since is not None:
            self.feed(target)

    def expire(self, now: float) -> None:
        """Drop the streams that have waited for credit for ``CREDIT_WAIT_S`` (their receiver
        keeps what it released; the next stream to that peer goes on)."""
        for target, queued in list(self._streams.items()):
            head = queued[0]
            if head.waiting_since is not None and now - head.waiting_since > CREDIT_WAIT_S:
                self._forget(queued.popleft())
                self._stats.drop("stream_credit_timeout")
                if queued:
                    self.feed(target)
                else:
                    del self._streams[target]

    def writable(self, events: dict[Any, int]) -> list[Target]:
        """The peers with streams whose sockets (the lane of their next chunk) have room again."""
        return [
            t
            for t, queued in self._streams.items()
            if events.get(self._socket_of(_lane(t, queued[0].chunks[0][0])), 0) & zmq.POLLOUT
        ]

    def feed(self, target: Target) -> None:
        """Send the peer's waiting chunks, each on its lane, in order, while the lanes take them,
        the receiver's credit allows and the cap too; then wait for room on the lane, for
        credit, or for the pacer."""
        queued = self._streams.get(target)
        first = self._connections.find(target)
        if first is not None and first.waiting:  # older messages wait for the connection: first
            self._wait_for_room(target, first)
            return
        while queued:
            stream = queued[0]
            if stream.sent >= stream.credited + self._window:
                stream.waiting_since = stream.waiting_since or self._clock()
                self._unpoll(target)
                self._retry.pop(target, None)
                return
            stream.waiting_since = None
            lane, frames = stream.chunks[0]
            connection = self._connections.find(_lane(target, lane))
            if connection is None:  # closed meanwhile (idle, evicted): what it had to send is gone
                self._drop_streams(target)
                self._stats.drop("stream_connection_closed")
                return
            if self._pacer is not None and self._pacer.wait_s() > 0:
                self._paused[target] = None
                self._unpoll(target)
                return
            try:
                connection.send(frames)
            except zmq.Again:
                self._wait_for_room(target, connection)
                return
            except RouteClosedError:
                self._connections.forget_route(target)  # (which drops its streams: see closed)
                return
            connection.used = self._clock()
            stream.chunks.popleft()
            stream.sent += 1
            self._count_sent(sum(_nbytes(f) for f in frames))
            if not stream.chunks:
                self._forget(queued.popleft())
                self._stats.messages_sent += 1
        self._streams.pop(target, None)
        self._unpoll(target)

    def _wait_for_room(self, target: Target, connection: Connection) -> None:
        self._unpoll(target)
        if not connection.routed:
            self._poller.want(connection.socket, zmq.POLLOUT)
        else:
            self._retry[target] = None

    def closed(self, target: Target, connection: Connection) -> None:
        """A connection (of any lane) is being closed: forget what its peer had left to send."""
        first = _lane(target, 0)
        self._paused.pop(first, None)
        self._retry.pop(first, None)
        if self._drop_streams(first):
            self._stats.drop("stream_connection_closed")
        self._unpoll(first)

    def _drop_streams(self, target: Target) -> bool:
        """Forget every stream queued to ``target``'s peer; whether there was one."""
        queued = self._streams.pop(target, None)
        for stream in queued or ():
            self._forget(stream)
        return bool(queued)

    def _forget(self, stream: _Queued) -> None:
        self._by_first.pop(stream.first_seq, None)

    def _count_sent(self, nbytes: int) -> None:
        self._stats.bytes_sent += nbytes
        if self._pacer is not None:
            self._pacer.spend(nbytes)

    def _socket_of(self, target: Target) -> zmq.Socket[bytes] | None:
        connection = self._connections.find(target)
        return connection.socket if connection is not None else None

    def _unpoll(self, target: Target) -> None:
        """Stop waiting for room on any lane to ``target``'s peer."""
        for lane in range(self._lanes + 1):
            socket = self._socket_of(_lane(target, lane))
            if socket is not None:
                self._poller.unwant(socket, zmq.POLLOUT)


@dataclass
class _Queued:
    """A stream to a peer: its (lane, chunk frames) left, and its receiver's credit."""

    chunks: deque[tuple[int, list[Any]]]
    first_seq: int
    key: bytes  # the receiver's CURVE key (b"": none)
    sent: int = 0  # chunks handed to ZeroMQ
    credited: int = 0  # chunks the receiver released
    waiting_since: float | None = None  # when it began to wait for credit


def _lane(target: Target, lane: int) -> Target:
    return target[0], target[1], lane


def _nbytes(frame: Any) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)
