"""The transport: one network thread that owns every ZeroMQ socket of a node.

A ROUTER socket receives from all peers; one DEALER per peer address and key sends
(``p2p.transport.connections``: bounded in number, closed when idle). A node that does not listen
(``listen=None``) has no ROUTER: it goes by ``inbound://ID``, reads what its peers send it on
its DEALERs, and they send it over their ROUTERs along the route its messages came by. Other
threads never touch a socket: :meth:`Transport.send` encodes on the caller's thread (no payload
copy; under a send cap, on the network thread as the message leaves) and hands the frames to
the network thread, which sends them without blocking (``p2p.transport.outbound``: a full or unreachable
peer drops the message and counts it). Received messages are decoded and validated on the
network thread; valid ones go to a bounded inbox that :meth:`Transport.recv` reads with a
timeout. Rejected ones are counted per reason and per peer (see ``p2p.security.rejections``); a peer
that keeps sending garbage is shunned, its messages dropped unread.

With a :class:`~p2p.security.curve.Curve` every socket is CURVE-encrypted and only peers with a trusted
key get a frame through (see ``p2p.security.curve``); without one, nothing is authenticated.

A payload larger than ``chunk_bytes`` goes as a stream of chunks (``p2p.wire.encode_chunks``):
the network thread feeds a peer's chunks to its socket as the socket takes them (waiting for
room rather than dropping; later streams to that peer go after it) and as far as the receiver's
credit allows (``p2p.transport.credits``: a window of chunks ahead of what the receiver has
released), and the receiver copies each chunk into place as it comes
(``p2p.transport.reassembly``), or hands it on as it is. No ZeroMQ message exceeds
``p2p.wire.MAX_CHUNK_BYTES``, which bounds what a peer can make a node buffer before checks.

Protocol services (membership, later failure detection) run on the network thread too: they
consume the message kinds they declare and get a periodic tick, the first once the socket is
bound and before any message, reader or command (membership learns its address there).

Whatever one message, command or tick raises ends that message, command or tick (counted: a
rejection ``handler_error``, or a drop ``command_failed`` / ``tick_failed``), never the thread.
The thread is supervised all the same: if it ever stops, :attr:`Transport.failure` says why,
``on_failure`` is called, and every later send or receive raises, so a node never trains alone
believing it gossips.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import math
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import zmq

from p2p.address import advertised, bind_form, check_node_id, inbound_address, parse_endpoint
from p2p.security.curve import Authenticator, Curve, configure_server
from p2p.security.identities import Identities
from p2p.security.ratelimit import QuietLog
from p2p.transport.connections import (
    CONNECT_GRACE_S,
    MAX_LANES,
    Connection,
    Connections,
    RouteClosedError,
    Target,
    close_when_silent,
    usable_at,
)
from p2p.transport.credits import CREDIT, CreditLedger
from p2p.transport.departures import Departure, Departures
from p2p.transport.inbound import HANDSHAKE_MS, InboundGuard
from p2p.transport.inbox import Inbox
from p2p.transport.outbound import WINDOW_BYTES, Outbound
from p2p.transport.polling import Poller
from p2p.transport.reassembly import Assembler, stream_name
from p2p.transport.send_cap import SendPacer
from p2p.transport.stats import TransportStats
from p2p.wire import (
    CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    Chunk,
    Limits,
    Message,
    WireError,
    decode,
    encode,
    encode_chunks,
    shown,
)

log = logging.getLogger(__name__)

_DRAIN_BATCH = 256
# the inbox's bounds in bytes, in messages of the largest size ``limits`` allows: all queues
# together, and one sender's queue of one kind (a state source's window of chunks fits)
INBOX_LARGEST_MESSAGES = 32
INBOX_LARGEST_PER_SENDER = 16
_HEADER_ALLOWANCE = 1 << 16
_HOUSEKEEPING_S = 1.0
_FLUSH_MS = 10
_CALL_POLL_S = 0.05  # how often a caller of call() checks that the network thread still runs


class TransportError(RuntimeError):
    """The transport cannot start or run; the message tells the user what to change."""


class Service(Protocol):
    """A protocol that runs on the network thread (e.g. membership)."""

    kinds: frozenset[str]

    def on_message(self, message: Message) -> None:
        """Handle one message of a kind in ``kinds``."""

    def on_tick(self, now: float) -> float:
        """Periodic work; returns the monotonic time of the next wanted tick. The first tick
        comes before anything else reaches the service."""


class Transport:
    """Sockets, codec and inbox of one node.

    Args:
        node_id: this node's id; stamped on every message and, with a random token after it
            (``NODE_ID/TOKEN``, see ``p2p.transport.connections``), used as the DEALER routing id, so a
            receiver can reject a header that claims another sender.
        listen: ``tcp://HOST:PORT`` to bind the ROUTER to (port 0 picks a free port); None:
            accept no connection (behind a NAT or a firewall), see above.
        advertise: the address peers dial; default: the bound address, a wildcard host
            replaced by this host's address.
        inbox_kinds: message kinds delivered to :meth:`recv`; other kinds not claimed by a
            service are rejected as ``unknown_kind``. None delivers every unclaimed kind.
        limits: decoder bounds; ``max_message_bytes`` also sets ZMQ_MAXMSGSIZE so an
            oversized frame is refused by ZeroMQ before it is buffered.
        send_queue: messages queued per peer before sends to it are dropped (ZMQ_SNDHWM).
        inbox_size: received messages held for the application before the oldest is dropped.
        inbox_per_sender: of those, how many one sender may have waiting of one kind.
            In bytes, the inbox holds at most ``INBOX_LARGEST_MESSAGES`` and one sender's
            queue of one kind ``INBOX_LARGEST_PER_SENDER`` messages of ``limits``' largest size.
        linger_s: how long :meth:`close` lets queued messages drain.
        curve: this node's keys and the trusted keys; None runs without CURVE (insecure).
        chunk_bytes: payloads larger than this go as a stream of chunks of this size.
        streams: connections a stream to a peer is spread over (``p2p.transport.connections``' lanes).
        max_send_bytes_per_s: a cap on what this node sends (``p2p.transport.send_cap``); None: none.
    """

    def __init__(
        self,
        node_id: str,
        listen: str | None,
        *,
        advertise: str | None = None,
        inbox_kinds: Iterable[str] | None = None,
        limits: Limits = Limits(),
        send_queue: int = 64,
        inbox_size: int = 4096,
        inbox_per_sender: int = 256,
        linger_s: float = 1.0,
        curve: Curve | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        max_send_bytes_per_s: float | None = None,
        streams: int = 1,
    ) -> None:
        self.node_id = check_node_id(node_id)
        if not 1 <= streams < MAX_LANES:
            raise TransportError(f"streams must be in 1..{MAX_LANES - 1}, got {streams}")
        self.curve = curve
        if listen is None and advertise:
            raise TransportError("a node that does not listen has no address to advertise; drop advertise=")
        self.listen = None if listen is None else parse_endpoint(listen)
        self.limits = limits
        self.stats = TransportStats()
        self.address = ""  # advertised endpoint, known after start()
        self._advertise = parse_endpoint(advertise) if advertise else None
        self._inbox_kinds = None if inbox_kinds is None else frozenset(inbox_kinds)
        self._linger_ms = int(linger_s * 1000)
        self._chunk_bytes = chunk_bytes
        self._lanes = streams
        # called (network thread) with an address no message could be queued to: the failure
        # detector hears of a closed connection at once rather than at its next probe
        self.on_unreachable: Callable[[str], None] | None = None
        # a service's check of a message bound for the inbox (membership: it comes from a member,
        # with the key of its record); it counts what it refuses itself
        self.screen: Callable[[Message], bool] | None = None
        # called (network thread, as it ends) if the network thread stops other than by close()
        self.on_failure: Callable[[str], None] | None = None
        self.failure: str | None = None
        self.stopped = threading.Event()  # set when the network thread has ended, for any reason
        self._assembler = Assembler()
        self._piece_kinds: frozenset[str] = frozenset()  # streams handed on chunk by chunk
        self._identities = Identities()
        self._poller = Poller()
        self._session = secrets.randbits(63)
        self._seq = itertools.count(1)
        self._send_order = threading.Lock()
        self._departures = Departures()
        self._services: dict[str, Service] = {}
        self._service_list: list[Service] = []
        self._readers: dict[int, Callable[[], None]] = {}
        self._inbox = Inbox(
            inbox_size,
            inbox_per_sender,
            max_bytes=INBOX_LARGEST_MESSAGES * limits.max_message_bytes,
            per_sender_bytes=INBOX_LARGEST_PER_SENDER * limits.max_message_bytes,
        )
        self._commands: deque[Callable[[], None]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._credits = CreditLedger(self._wake)
        self._context = zmq.Context()
        self.connections = Connections(
            self._context,
            node_id=self.node_id,
            curve=curve,
            send_queue=send_queue,
            linger_ms=self._linger_ms,
            on_close=self._closed,
            poller=self._poller,
            receives=True,  # (credit for streams comes back on the connection they went over)
        )
        self._outbound = Outbound(
            self.connections,
            self._poller,
            self.stats,
            SendPacer(max_send_bytes_per_s) if max_send_bytes_per_s else None,
            self._guarded,
            lambda address: self.on_unreachable(address) if self.on_unreachable is not None else None,
            lanes=streams,
            window_chunks=max(2, streams, WINDOW_BYTES // chunk_bytes),
        )
        self._authenticator: Authenticator | None = None
        self._errors = QuietLog(log)
        self.inbound: InboundGuard | None = None  # the caps on inbound TCP connections, once bound
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._startup_error: TransportError | None = None
        self._stop_at = math.inf
        self._next_tick = 0.0
        self._next_housekeeping = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    def add_service(self, service: Service) -> None:
        """Register a network-thread protocol; call before :meth:`start`."""
        if self._thread is not None:
            raise RuntimeError("add services before start()")
        for kind in service.kinds:
            self._services[kind] = service
        self._service_list.append(service)

    def add_reader(self, fd: int, on_readable: Callable[[], None]) -> None:
        """Have the network thread call ``on_readable`` when ``fd`` (e.g. a UDP socket) has
        data; call before :meth:`start`."""
        if self._thread is not None:
            raise RuntimeError("add readers before start()")
        self._readers[fd] = on_readable

    def start(self, timeout: float = 10.0) -> str:
        """Bind and start the network thread; returns the advertised address."""
        self._thread = threading.Thread(target=self._run, name=f"net-{self.node_id}", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise TransportError(f"network thread did not start within {timeout} s")
        error = self._startup_error or (self._stopped() if self.failure else None)
        if error is not None:
            self._close_context()
            raise error
        return self.address

    def close(self, timeout: float = 5.0) -> None:
        """Stop the network thread; queued messages get ``linger_s`` to leave."""
        if self._thread is not None and self._thread.is_alive():
            self._stop_at = time.monotonic() + CONNECT_GRACE_S  # sends waiting for a new connection
            self._wake()
            self._thread.join(timeout)
        self._close_context()

    def check_running(self) -> None:
        """Raise TransportError if the network thread has died (it never sends again)."""
        if self.failure is not None:
            raise self._stopped()

    def _stopped(self) -> TransportError:
        return TransportError(
            f"the network thread of {self.node_id} stopped ({self.failure}); restart the node"
        )

    # -- any thread --------------------------------------------------------------------------

    def send(
        self,
        address: str,
        kind: str,
        round: int,
        tensors: Sequence[np.ndarray] = (),
        meta: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        member: bool = False,
        patient: bool = False,
    ) -> None:
        """Queue a message to the node at ``address``; never blocks.

        ``key``: the CURVE key expected there (None: not known, try every trusted key);
        ``member``: whether ``address`` is a member's (else its connection is short-lived);
        ``patient``: on a connection still in its handshake, the message waits for it (as a
        member's do) instead of being dropped (see ``p2p.transport.connections``).
        Tensors are sent from their own memory: do not modify them afterwards.
        """
        fields: dict[str, Any] = {
            "kind": kind, "sender": self.node_id, "round": round, "tensors": tensors, "meta": meta
        }  # fmt: skip
        # a message with tensors is tracked until it leaves (``backlog``)
        departure = self._departures.start(address) if tensors else None
        out = _Outgoing(address, key, member, patient, fields, departure)
        if self._outbound.paced:  # encoded when it leaves (its seq then), see _hold
            self.call_soon(lambda: self._hold(out))
            return
        with self._send_order:  # seq order == queue order, so receivers see seqs increase
            self.call_soon(self._encoded(out))

    def backlog(self, address: str) -> int:
        """Messages with tensors sent to ``address`` that have not left this node yet (see
        ``p2p.transport.departures``); any thread."""
        return self._departures.count(address)

    def _encoded(self, out: _Outgoing) -> Callable[[], None]:
        """The message encoded (its sequence numbers taken now), as the send to run."""
        fields, departure = out.fields, out.departure
        try:
            if sum(t.nbytes for t in fields["tensors"]) <= self._chunk_bytes:
                frames = encode(**fields, session=self._session, seq=next(self._seq))
                if departure is not None:
                    departure.track(frames)
                return lambda: self._outbound.send_now(
                    out.address, out.key, out.member, frames, patient=out.patient
                )
            first = next(self._seq)
            chunks = encode_chunks(
                **fields,
                session=self._session,
                seqs=itertools.chain([first], self._seq),
                chunk_bytes=self._chunk_bytes,
            )
            if departure is not None:  # (each connection's last chunk: they go over them in turn)
                for chunk in chunks[-self._lanes :]:
                    departure.track(chunk)
            return lambda: self._outbound.send_stream(out.address, out.key, out.member, chunks, first)
        except BaseException:
            if departure is not None:
                departure.gone()
            raise

    def take_pieces(self, kinds: Collection[str]) -> None:
        """Hand on the large messages of ``kinds`` chunk by chunk, as they come, instead of
        whole (see ``p2p.transport.reassembly``); any thread. Their readers mix each piece in."""
        self._piece_kinds = self._piece_kinds | frozenset(kinds)

    def recv(self, timeout: float, kinds: Collection[str] | None = None) -> Message | None:
        """The oldest inbox message (of one of ``kinds``, if given), or None after ``timeout``
        s or a :meth:`notify`. Messages of other kinds stay for their own readers."""
        return self._inbox.get(timeout, kinds)

    def notify(self) -> None:
        """Make threads blocked in :meth:`recv` return (used when membership changes)."""
        self._inbox.notify()

    def tick_within(self, delay: float) -> None:
        """Run the services' ticks within ``delay`` s (network thread only)."""
        self._next_tick = min(self._next_tick, time.monotonic() + delay)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the network thread, after what was queued before it."""
        if self._context.closed or self.failure is not None:
            self.stats.drop("closed" if self.failure is None else "network_down")
            return
        self._commands.append(fn)
        if threading.current_thread() is not self._thread:
            self._wake()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the network thread and return once it ran: what it changes is seen by
        the caller's next read (at once on the network thread itself; queued for the start
        before :meth:`start`; not at all once the network is down)."""
        if self._thread is None:  # (it runs first thing when the thread starts)
            self.call_soon(fn)
            return
        if threading.current_thread() is self._thread:
            fn()
            return
        ran = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                ran.set()

        self.call_soon(run)
        while not ran.wait(_CALL_POLL_S):
            if self.stopped.is_set() or self._context.closed or self.failure is not None:
                return

    # -- network thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # supervised: whatever ends the thread is reported, not lost
            self.failure = f"{type(exc).__name__}: {shown(str(exc))}"
            log.error("the network thread of %s stopped", self.node_id, exc_info=True)
            if self.on_failure is not None:
                with contextlib.suppress(Exception):
                    self.on_failure(self.failure)
        finally:
            self._started.set()
            self.stopped.set()

    def _serve(self) -> None:
        router = None
        if self.listen is None:
            self.address = inbound_address(self.node_id)
        else:
            router = self._bind(self.listen)
            if router is None:
                return
            self._poller.register(router, zmq.POLLIN)
            if self.listen.startswith("tcp://"):
                self.inbound = InboundGuard(router)
                self._poller.register(self.inbound.monitor, zmq.POLLIN)
        self.connections.router = router
        poller = self._poller
        poller.register(self._wake_r, zmq.POLLIN)
        for fd in self._readers:
            poller.register(fd, zmq.POLLIN)
        self._tick_services(time.monotonic())
        self._started.set()
        try:
            while time.monotonic() < self._stop_at:
                self._turn(router)
            self._run_commands()  # last sends (e.g. a leave) before the sockets close
        finally:
            if self.inbound is not None:
                self.inbound.close()
            if router is not None:
                router.close(linger=0)
            self.connections.close_all()

    def _bind(self, listen: str) -> zmq.Socket[bytes] | None:
        """The ROUTER, bound, with this node's address set; None (and the startup error set)
        when it cannot bind."""
        if self.curve is not None:
            self._authenticator = Authenticator(self._context, self.curve.trusted)
        router = self._context.socket(zmq.ROUTER)
        if self.curve is not None:
            configure_server(router, self.curve.keys)
        largest = min(self.limits.max_message_bytes, MAX_CHUNK_BYTES)
        router.setsockopt(zmq.MAXMSGSIZE, largest + _HEADER_ALLOWANCE)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send along a route that is gone fails
        # A DEALER whose connection dropped reconnects under its routing id; when this thread was
        # busy meanwhile, libzmq still holds the old connection under that id, and without
        # handover files the new one where nothing is read: all it carries is lost until its
        # queue fills and its input stops (see ``close_when_silent``). Ids are random per DEALER
        # (``Connections``), so the one that takes an id over is the socket that held it.
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        close_when_silent(router)  # (an inbound connection from a crashed host, a partition)
        router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)  # (strangers' idle connections end)
        try:
            router.bind(bind_form(listen))
            self.address = self._advertise or advertised(router.getsockopt_string(zmq.LAST_ENDPOINT))
        except zmq.ZMQError as exc:
            router.close()
            self._startup_error = _bind_error(listen, exc)
            return None
        return router

    def _turn(self, router: zmq.Socket[bytes] | None) -> None:
        """One pass of the loop: wait for input or the next tick, then handle what is due."""
        due_ms = int((min(self._next_tick, self._next_housekeeping, self._stop_at) - time.monotonic()) * 1000)
        if self.connections.waiting or self._outbound.retrying:  # (connections to come up, routes
            due_ms = min(due_ms, _FLUSH_MS)  # to have room): look again soon
        paced_ms = self._outbound.due_ms()
        if paced_ms is not None:  # sends wait for the send cap
            due_ms = min(due_ms, paced_ms)
        events = dict(self._poller.poll(0 if self._commands else max(0, due_ms)))
        if self.inbound is not None and self.inbound.monitor in events:
            self._guarded("inbound", self.inbound.drain)
        if router is not None and router in events:
            self._drain(router)
        for target, connection in self.connections.readable(events):
            self._drain_replies(target, connection)
        self._send_credits(router)
        self.connections.read_refusals(events)
        if self._wake_r in events:
            self._drain_wakeups()
        for fd, on_readable in self._readers.items():
            if fd in events:
                self._guarded("reader", on_readable)
        for target in self._outbound.writable(events):
            self._guarded("stream", lambda target=target: self._outbound.feed(target))  # type: ignore[misc]
        self._run_commands()
        self._outbound.retry()
        self._outbound.release()
        for _ in range(self.connections.flush()):
            self.stats.drop("peer_unreachable_or_full")
        now = time.monotonic()
        if now >= self._next_tick:
            self._tick_services(now)
        if now >= self._next_housekeeping:
            if self._authenticator is not None:
                self._authenticator.check()  # supervised: its death is this thread's failure
            self.connections.expire(now)
            self._assembler.expire(now)
            self._credits.expire(now)
            self._outbound.expire(now)
            self._next_housekeeping = now + _HOUSEKEEPING_S

    def _tick_services(self, now: float) -> None:
        self._next_tick = min((self._tick(s, now) for s in self._service_list), default=now + 1.0)

    def _tick(self, service: Service, now: float) -> float:
        try:
            return service.on_tick(now)
        except Exception:
            self._failed("tick")
            return now + 1.0

    def _guarded(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            self._failed(what)

    def _failed(self, what: str) -> None:
        """Count and log (rate-limited) an exception in one unit of the thread's work."""
        self.stats.drop(f"{what}_failed")
        self._errors.warning(what, "%s: a %s failed; the thread goes on", self.node_id, what, exc_info=True)

    def _drain(self, router: zmq.Socket[bytes]) -> None:
        for _ in range(_DRAIN_BATCH):
            try:
                frames = router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.stats.bytes_received += sum(len(f) for f in frames[1:])
            if self.inbound is not None:
                self.inbound.heard(frames[0])
            self._accept(frames[0].bytes, frames[1:])

    def _drain_replies(self, target: Target, connection: Connection) -> None:
        """What a peer sent back on a connection this node opened (it does not listen): the
        sender is who the header says, under the key this connection verified."""
        for _ in range(_DRAIN_BATCH):
            try:
                frames = connection.socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.stats.bytes_received += sum(len(f) for f in frames)
            self._accept(target, frames, key=target[1].decode())

    def reject(self, peer: str, reason: str, detail: str = "") -> None:
        """Count a message from ``peer`` that was rejected (network thread; services use it too)."""
        self.stats.rejections.reject(peer, reason, detail)

    def peer_name(self, message: Message) -> str:
        """Who sent ``message``, as rejections count it (the sender's key when CURVE is on)."""
        return self._identities.name(message.key, message.sender)

    def _accept(self, via: bytes | Target, frames: Sequence[zmq.Frame], key: str | None = None) -> None:
        """One received message, in its own error scope: whatever it raises is its rejection.
        ``via``: the routing id of the sender's connection to the ROUTER, or the target of the
        DEALER it came back on (from the peer with ``key``)."""
        claimed, lane = _claimed(via) if isinstance(via, bytes) else (None, "")
        if key is None:
            key = _user_id(frames[0]) if self.curve is not None and frames else ""
        peer = self._identities.name(key, claimed or "?")
        try:
            if self.stats.rejections.shunned(peer):
                self.reject(peer, "shunned")
            else:
                self._take(key, claimed, lane, via, frames)
        except WireError as exc:
            self.reject(peer, exc.reason, exc.detail)
        except Exception as exc:  # a bug, or an input no check foresaw: this message's end only
            self.reject(peer, "handler_error", f"{type(exc).__name__}: {shown(str(exc))}")
            self._errors.warning("accept", "a message from %s raised", peer, exc_info=True)

    def _take(
        self,
        key: str,
        claimed: str | None,
        lane_text: str,
        via: bytes | Target,
        frames: Sequence[zmq.Frame],
    ) -> None:
        """Check and deliver one message that came ``via`` a connection: the routing id of the
        sender's DEALER at the ROUTER, or the target of this node's DEALER it came back on."""
        lane = int(lane_text) if lane_text.isdigit() and len(lane_text) <= 2 else -1 if lane_text else 0
        if not 0 <= lane < MAX_LANES:
            raise WireError("bad_lane", f"lane {shown(lane_text)} of a connection (0..{MAX_LANES - 1})")
        decoded = decode(frames, self.limits)
        message = decoded.message if isinstance(decoded, Chunk) else decoded
        if claimed is not None and message.sender != claimed:
            raise WireError("sender_mismatch", f"header says {shown(message.sender)}")
        claimed = message.sender
        if message.kind == CREDIT:  # (cumulative: a replayed or reordered one changes nothing)
            self._take_credit(message, key)
            return
        if isinstance(via, tuple) and self.listen is not None:
            raise WireError("unexpected_reply", f"a {shown(message.kind)} message back on a connection")
        # chunks and whole messages are each in order on a connection, not with each other
        sequence = lane + MAX_LANES if isinstance(decoded, Chunk) else lane
        last = self._identities.replayed(key, claimed, message.session, message.seq, sequence)
        if last is not None:
            raise WireError("replayed", f"seq {message.seq} <= {last}")
        if isinstance(via, bytes) and lane == 0:
            self.connections.note_route(claimed, key, via)
        if isinstance(decoded, Chunk):
            self._credits.hold(stream_name(decoded, key or claimed), decoded.count, via, frames[1:])
            whole = message.kind not in self._piece_kinds
            taken = (self._assembler.add if whole else self._assembler.piece)(decoded, key or claimed)
            if taken is None:
                return
            message = taken
        message = replace(message, key=key)
        self.stats.messages_received += 1
        service = self._services.get(message.kind)
        if service is not None:
            service.on_message(message)
        elif self._inbox_kinds is not None and message.kind not in self._inbox_kinds:
            raise WireError("unknown_kind", shown(message.kind))
        elif self.screen is not None and not self.screen(message):
            return
        elif not self._inbox.put(message):
            self.stats.drop("inbox_full")

    def _take_credit(self, message: Message, key: str) -> None:
        """A receiver's credit for a stream this node sends (see ``p2p.transport.credits``)."""
        session, stream, released = (_credit_field(message, f) for f in ("session", "stream", "released"))
        if session == self._session:  # (else a credit for an earlier run's stream: nothing to do)
            self._outbound.credit(stream, released, key)

    def _send_credits(self, router: zmq.Socket[bytes] | None) -> None:
        """Tell senders of the chunks of their streams released since they were last told, each
        on the connection its chunk came over."""
        for via, meta in self._credits.due():
            seq, session = next(self._seq), self._session
            frames = encode(kind=CREDIT, sender=self.node_id, round=0, meta=meta, session=session, seq=seq)
            connection = self.connections.find(via) if isinstance(via, tuple) else None
            try:
                if isinstance(via, bytes) and router is not None:
                    router.send_multipart([via, *frames], flags=zmq.NOBLOCK)
                elif connection is not None:
                    connection.send(frames)
                else:
                    raise zmq.Again
            except (zmq.ZMQError, RouteClosedError):  # gone, or full: a later credit makes up for it
                self.stats.drop("credit_unsent")
                continue
            self.stats.bytes_sent += sum(len(f) for f in frames)

    def ready_at(self, address: str, key: str | None = None, *, member: bool = False) -> float:
        """Open the connection(s) to ``address`` ahead of the first send, if not open; returns
        when they can be sent on (network thread only)."""
        connections = [
            self.connections.get(t, verified=member) for t in self.connections.targets(address, key)
        ]
        return max((usable_at(c) for c in connections if c is not None), default=0.0)

    def disconnect(self, address: str) -> None:
        """Close the connections to ``address``, dropping what is queued (network thread only)."""
        self.connections.close_address(address)

    def _hold(self, out: _Outgoing) -> None:
        """With a send cap: a service's message (membership: small, and late it would make
        peers suspect this node) leaves now (behind a stream being fed to that peer, though);
        the others wait their turn, encoded as they leave so that sequence numbers go out in
        order whatever passed them (network thread)."""
        if out.fields["kind"] in self._services:
            self._encoded(out)()
        else:
            self._outbound.hold(lambda: self._encoded(out)(), out.departure)

    def _closed(self, target: Target, connection: Connection) -> None:
        self._outbound.closed(target, connection)

    def _run_commands(self) -> None:
        while self._commands:
            self._guarded("command", self._commands.popleft())

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # pipe full: the thread is awake anyway
            os.write(self._wake_w, b"\0")

    def _drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def _close_context(self) -> None:
        if self._context.closed:
            return
        if self._authenticator is not None:
            self._authenticator.stop()
        self._credits.close()  # (before the wake-up pipe closes: a chunk freed later wakes nothing)
        if self._thread is not None and self._thread.is_alive():
            self._context.term()  # its blocking calls end (ETERM), and it closes its sockets
        else:  # (any socket left open would keep term() waiting for ever: none may hang a close)
            self._context.destroy(linger=0)
        os.close(self._wake_r)
        os.close(self._wake_w)


@dataclass(frozen=True)
class _Outgoing:
    """A message on its way to the network thread: to whom, how, and what tracks it."""

    address: str
    key: str | None  # the CURVE key expected there (None: try every trusted key)
    member: bool
    patient: bool
    fields: dict[str, Any]  # what ``p2p.wire.encode`` takes, but the sequence numbers
    departure: Departure | None  # (messages with tensors)


def _credit_field(message: Message, name: str) -> int:
    value = message.meta.get(name)
    if message.tensors or not isinstance(value, int) or value < 0:
        raise WireError("bad_credit", f"credit must carry session, stream, released: {shown(message.meta)}")
    return value


def _claimed(routing_id: bytes) -> tuple[str, str]:
    """The id a connection's routing id (``NODE_ID/TOKEN[/LANE]``) claims, and its lane ("")."""
    claimed, _, rest = routing_id.decode("ascii", errors="replace").partition("/")
    return claimed, rest.partition("/")[2]


def _user_id(frame: zmq.Frame) -> str:
    """The CURVE public key the ZAP handler admitted this frame's connection with."""
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:
        return ""


def _bind_error(listen: str, exc: zmq.ZMQError) -> TransportError:
    if exc.errno == errno.EADDRINUSE:
        return TransportError(
            f"{listen} is in use; stop the process holding it or pass listen= with port 0 "
            "(e.g. tcp://127.0.0.1:0) to pick a free one"
        )
    return TransportError(
        f"cannot listen on {listen}: {exc.strerror}; use an address of this host, "
        "e.g. tcp://127.0.0.1:0 or tcp://0.0.0.0:7000"
    )
