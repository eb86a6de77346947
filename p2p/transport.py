"""The transport: one network thread that owns every ZeroMQ socket of a node.

A ROUTER socket receives from all peers; one DEALER per peer address sends. Other threads never
touch a socket: :meth:`Transport.send` encodes on the caller's thread (no payload copy) and hands
the frames to the network thread, which sends them without blocking (a full or unreachable peer
drops the message and counts it). Received messages are decoded and validated on the network
thread; valid ones go to a bounded inbox that :meth:`Transport.recv` reads with a timeout.
Rejected ones are counted per reason and per peer (see ``p2p.rejections``); a peer that keeps
sending garbage is shunned, its messages dropped unread.

With a :class:`~p2p.security.Curve` every socket is CURVE-encrypted and only peers with a trusted
key get a frame through (see ``p2p.security``); without one, nothing is authenticated.

A payload larger than ``chunk_bytes`` goes as a stream of chunks (``p2p.wire.encode_chunks``):
the network thread feeds a peer's chunks to its socket as the socket takes them (waiting for
room rather than dropping), so small messages to that peer still pass between chunks, and the
receiver copies each chunk into place as it comes (``p2p.stream``). No ZeroMQ message exceeds
``p2p.wire.MAX_CHUNK_BYTES``, which bounds what a peer can make a node buffer before checks.

Protocol services (membership, later failure detection) run on the network thread too: they
consume the message kinds they declare and get a periodic tick.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import zmq

from p2p.address import advertised, bind_form, check_node_id, parse_endpoint
from p2p.inbox import Inbox
from p2p.rejections import Rejections
from p2p.security import Authenticator, Curve, configure_client, configure_server
from p2p.stream import Assembler
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
)

_DRAIN_BATCH = 256
_HEADER_ALLOWANCE = 1 << 16
_HEARTBEAT_MS = 1000
MAX_STREAMS_PER_PEER = 4  # streams waiting for one peer's socket; more drop the oldest


class TransportError(RuntimeError):
    """The transport cannot start or run; the message tells the user what to change."""


class Service(Protocol):
    """A protocol that runs on the network thread (e.g. membership)."""

    kinds: frozenset[str]

    def on_message(self, message: Message) -> None:
        """Handle one message of a kind in ``kinds``."""

    def on_tick(self, now: float) -> float:
        """Periodic work; returns the monotonic time of the next wanted tick."""


@dataclass
class TransportStats:
    """Counters kept by the network thread; read them from any thread."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    rejections: Rejections = field(default_factory=Rejections)

    @property
    def rejected(self) -> Counter[str]:
        """Rejected messages by reason."""
        return self.rejections.by_reason

    @property
    def rejected_by_peer(self) -> dict[str, Counter[str]]:
        return self.rejections.by_peer

    @property
    def messages_rejected(self) -> int:
        return self.rejections.total


class Transport:
    """Sockets, codec and inbox of one node.

    Args:
        node_id: this node's id; stamped on every message and used as the DEALER routing id,
            so a receiver can reject a header that claims another sender.
        listen: ``tcp://HOST:PORT`` to bind the ROUTER to (port 0 picks a free port).
        advertise: the address peers dial; default: the bound address, a wildcard host
            replaced by this host's address.
        inbox_kinds: message kinds delivered to :meth:`recv`; other kinds not claimed by a
            service are rejected as ``unknown_kind``. None delivers every unclaimed kind.
        limits: decoder bounds; ``max_message_bytes`` also sets ZMQ_MAXMSGSIZE so an
            oversized frame is refused by ZeroMQ before it is buffered.
        send_queue: messages queued per peer before sends to it are dropped (ZMQ_SNDHWM).
        inbox_size: received messages held for the application before the oldest is dropped.
        linger_s: how long :meth:`close` lets queued messages drain.
        curve: this node's keys and the trusted keys; None runs without CURVE (insecure).
        chunk_bytes: payloads larger than this go as a stream of chunks of this size.
    """

    def __init__(
        self,
        node_id: str,
        listen: str,
        *,
        advertise: str | None = None,
        inbox_kinds: Iterable[str] | None = None,
        limits: Limits = Limits(),
        send_queue: int = 64,
        inbox_size: int = 4096,
        linger_s: float = 1.0,
        curve: Curve | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.node_id = check_node_id(node_id)
        self.curve = curve
        self.listen = parse_endpoint(listen)
        self.limits = limits
        self.stats = TransportStats()
        self.address = ""  # advertised endpoint, known after start()
        self._advertise = parse_endpoint(advertise) if advertise else None
        self._inbox_kinds = None if inbox_kinds is None else frozenset(inbox_kinds)
        self._send_queue = send_queue
        self._linger_ms = int(linger_s * 1000)
        self._chunk_bytes = chunk_bytes
        # called (network thread) with an address no message could be queued to: the failure
        # detector hears of a closed connection at once rather than at its next probe
        self.on_unreachable: Callable[[str], None] | None = None
        self._assembler = Assembler()
        self._streams: dict[str, deque[deque[list[Any]]]] = {}  # address -> streams left to send
        self._poller = zmq.Poller()
        self._session = secrets.randbits(63)
        self._seq = itertools.count(1)
        self._send_order = threading.Lock()
        self._services: dict[str, Service] = {}
        self._service_list: list[Service] = []
        self._readers: dict[int, Callable[[], None]] = {}
        self._inbox = Inbox(inbox_size)
        self._commands: deque[Callable[[], None]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._context = zmq.Context()
        self._dealers: dict[str, dict[bytes, zmq.Socket[bytes]]] = {}  # address -> server key -> socket
        self._server_keys: dict[str, bytes] = {}  # address -> its CURVE public key, once known
        self._authenticator: Authenticator | None = None
        self._last_seq: dict[str, tuple[int, int]] = {}
        self._peer_keys: dict[str, str] = {}  # sender id -> the CURVE key its messages came with
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._startup_error: TransportError | None = None
        self._stopping = False
        self._next_tick = 0.0

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
        if self._startup_error is not None:
            self._close_context()
            raise self._startup_error
        return self.address

    def close(self, timeout: float = 5.0) -> None:
        """Stop the network thread; queued messages get ``linger_s`` to leave."""
        if self._thread is not None and self._thread.is_alive():
            self._stopping = True
            self._wake()
            self._thread.join(timeout)
        self._close_context()

    # -- any thread --------------------------------------------------------------------------

    def send(
        self,
        address: str,
        kind: str,
        round: int,
        tensors: Sequence[np.ndarray] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        """Queue a message to the node at ``address``; never blocks.

        Tensors are sent from their own memory: do not modify them afterwards.
        """
        fields: dict[str, Any] = {
            "kind": kind, "sender": self.node_id, "round": round, "tensors": tensors, "meta": meta
        }  # fmt: skip
        with self._send_order:  # seq order == queue order, so receivers see seqs increase
            if sum(t.nbytes for t in tensors) <= self._chunk_bytes:
                frames = encode(**fields, session=self._session, seq=next(self._seq))
                self.call_soon(lambda: self._send_now(address, frames))
            else:
                chunks = encode_chunks(
                    **fields, session=self._session, seqs=self._seq, chunk_bytes=self._chunk_bytes
                )
                self.call_soon(lambda: self._send_stream(address, chunks))

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
        if self._context.closed:
            self.stats.dropped["closed"] += 1
            return
        self._commands.append(fn)
        if threading.current_thread() is not self._thread:
            self._wake()

    # -- network thread ----------------------------------------------------------------------

    def _run(self) -> None:
        if self.curve is not None:
            self._authenticator = Authenticator(self._context, self.curve.trusted)
        router = self._context.socket(zmq.ROUTER)
        if self.curve is not None:
            configure_server(router, self.curve.keys)
        largest = min(self.limits.max_message_bytes, MAX_CHUNK_BYTES)
        router.setsockopt(zmq.MAXMSGSIZE, largest + _HEADER_ALLOWANCE)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        router.setsockopt(zmq.LINGER, 0)
        try:
            router.bind(bind_form(self.listen))
            self.address = self._advertise or advertised(router.getsockopt_string(zmq.LAST_ENDPOINT))
        except zmq.ZMQError as exc:
            router.close()
            self._startup_error = _bind_error(self.listen, exc)
            self._started.set()
            return
        poller = self._poller
        poller.register(router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        for fd in self._readers:
            poller.register(fd, zmq.POLLIN)
        self._started.set()
        try:
            while not self._stopping:
                due_ms = int((self._next_tick - time.monotonic()) * 1000)
                wait_ms = 0 if self._commands else max(0, due_ms)
                events = dict(poller.poll(wait_ms))
                if router in events:
                    self._drain(router)
                if self._wake_r in events:
                    self._drain_wakeups()
                for fd, on_readable in self._readers.items():
                    if fd in events:
                        on_readable()
                for address in [a for a in self._streams if events.keys() & self._dealer(a).values()]:
                    self._feed(address)
                self._run_commands()
                now = time.monotonic()
                if now >= self._next_tick:
                    self._next_tick = min((s.on_tick(now) for s in self._service_list), default=now + 1.0)
            self._run_commands()  # last sends (e.g. a leave) before the sockets close
        finally:
            router.close(linger=0)
            for dealers in self._dealers.values():
                for dealer in dealers.values():
                    dealer.close(linger=self._linger_ms)

    def _drain(self, router: zmq.Socket[bytes]) -> None:
        for _ in range(_DRAIN_BATCH):
            try:
                frames = router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.stats.bytes_received += sum(len(f) for f in frames[1:])
            self._accept(frames[0].bytes, frames[1:])

    def reject(self, peer: str, reason: str, detail: str = "") -> None:
        """Count a message from ``peer`` that was rejected (network thread; services use it too)."""
        self.stats.rejections.reject(peer, reason, detail)

    def peer_name(self, message: Message) -> str:
        """Who sent ``message``, as rejections count it (the sender's key when CURVE is on)."""
        key = self._peer_keys.get(message.sender)
        return f"{message.sender} ({key})" if key else message.sender

    def _accept(self, routing_id: bytes, frames: Sequence[zmq.Frame]) -> None:
        claimed = routing_id.decode("ascii", errors="replace")
        key = _user_id(frames[0]) if self.curve is not None and frames else ""
        peer = f"{claimed} ({key})" if key else claimed
        if self.stats.rejections.shunned(peer):
            self.reject(peer, "shunned")
            return
        try:
            decoded = decode(frames, self.limits)
        except WireError as exc:
            self.reject(peer, exc.reason, exc.detail)
            return
        message = decoded.message if isinstance(decoded, Chunk) else decoded
        if message.sender != claimed:
            self.reject(peer, "sender_mismatch", f"header says {message.sender!r}")
            return
        last = self._last_seq.get(message.sender)
        if last is not None and last[0] == message.session and message.seq <= last[1]:
            self.reject(peer, "replayed", f"seq {message.seq} <= {last[1]}")
            return
        if key:
            self._peer_keys[message.sender] = key
        self._last_seq[message.sender] = (message.session, message.seq)
        if isinstance(decoded, Chunk):
            try:
                assembled = self._assembler.add(decoded)
            except WireError as exc:
                self.reject(peer, exc.reason, exc.detail)
                return
            if assembled is None:
                return
            message = assembled
        self.stats.messages_received += 1
        service = self._services.get(message.kind)
        if service is not None:
            service.on_message(message)
        elif self._inbox_kinds is None or message.kind in self._inbox_kinds:
            if not self._inbox.put(message):
                self.stats.dropped["inbox_full"] += 1
        else:
            self.reject(peer, "unknown_kind", message.kind)

    def connect(self, address: str) -> None:
        """Open the connection to ``address`` ahead of the first send (network thread only)."""
        self._dealer(address)

    def disconnect(self, address: str) -> None:
        """Close the connection to ``address``, dropping what is queued (network thread only)."""
        self._streams.pop(address, None)
        for dealer in self._dealers.pop(address, {}).values():
            if dealer in self._poller:
                self._poller.unregister(dealer)
            dealer.close(linger=0)

    def learn_key(self, address: str, key: bytes) -> None:
        """The CURVE public key of the node at ``address`` (from its member record; network
        thread). Connections tried with other keys are closed; an untrusted key is ignored."""
        if self.curve is None or self._server_keys.get(address) == key or not self.curve.trusted.allows(key):
            return
        self._server_keys[address] = key
        dealers = self._dealers.get(address, {})
        for other in [k for k in dealers if k != key]:
            dealer = dealers.pop(other)
            if dealer in self._poller:
                self._poller.unregister(dealer)
            dealer.close(linger=0)

    def _dealer(self, address: str) -> dict[bytes, zmq.Socket[bytes]]:
        """The connection(s) to ``address``: one, or with CURVE and its key not known yet (a
        bootstrap address), one per trusted key, of which only the right one completes."""
        dealers = self._dealers.get(address)
        if not dealers:
            if self.curve is None:
                keys: Iterable[bytes] = [b""]
            elif address in self._server_keys:
                keys = [self._server_keys[address]]
            else:
                keys = sorted(self.curve.trusted.current())
            dealers = self._dealers[address] = {key: self._open_dealer(address, key) for key in keys}
        return dealers

    def _send_now(self, address: str, frames: list[Any]) -> None:
        sent = 0
        for dealer in self._dealer(address).values():
            try:
                dealer.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                sent += 1
            except zmq.Again:
                continue
        if not sent:
            self.stats.dropped["peer_unreachable_or_full"] += 1
            if self.on_unreachable is not None:
                self.on_unreachable(address)
            return
        self.stats.messages_sent += 1
        self.stats.bytes_sent += sum(_nbytes(f) for f in frames)

    def _send_stream(self, address: str, chunks: list[list[Any]]) -> None:
        if len(self._dealer(address)) != 1:  # CURVE, and the peer's key not known yet
            self.stats.dropped["peer_key_unknown"] += 1
            return
        streams = self._streams.setdefault(address, deque())
        if len(streams) >= MAX_STREAMS_PER_PEER:
            streams.popleft()  # its receiver discards the unfinished stream when the next begins
            self.stats.dropped["stream_backlog"] += 1
        streams.append(deque(chunks))
        self._feed(address)

    def _feed(self, address: str) -> None:
        """Send the peer's waiting chunks while its socket takes them; then wait for room."""
        streams = self._streams.get(address)
        (dealer,) = self._dealer(address).values()
        while streams:
            chunks = streams[0]
            try:
                dealer.send_multipart(chunks[0], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if dealer not in self._poller:
                    self._poller.register(dealer, zmq.POLLOUT)
                return
            self.stats.bytes_sent += sum(_nbytes(f) for f in chunks.popleft())
            if not chunks:
                streams.popleft()
                self.stats.messages_sent += 1
        self._streams.pop(address, None)
        if dealer in self._poller:
            self._poller.unregister(dealer)

    def _open_dealer(self, address: str, server_key: bytes) -> zmq.Socket[bytes]:
        dealer = self._context.socket(zmq.DEALER)
        if self.curve is not None:
            configure_client(dealer, self.curve.keys, server_key)
        dealer.setsockopt(zmq.ROUTING_ID, self.node_id.encode())
        dealer.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a live connection: a dead peer drops
        # a connection that goes silent (a partition, a crashed host) is dropped and redialed
        dealer.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * _HEARTBEAT_MS)
        dealer.setsockopt(zmq.SNDHWM, self._send_queue)
        dealer.setsockopt(zmq.LINGER, self._linger_ms)
        dealer.connect(address)
        return dealer

    def _run_commands(self) -> None:
        while self._commands:
            self._commands.popleft()()

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
        self._context.term()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _user_id(frame: zmq.Frame) -> str:
    """The CURVE public key the ZAP handler admitted this frame's connection with."""
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:
        return ""


def _nbytes(frame: Any) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


def _bind_error(listen: str, exc: zmq.ZMQError) -> TransportError:
    if exc.errno == errno.EADDRINUSE:
        return TransportError(
            f"{listen} is in use; stop the process holding it or pass --listen with port 0 "
            "(e.g. tcp://127.0.0.1:0) to pick a free one"
        )
    return TransportError(
        f"cannot listen on {listen}: {exc.strerror}; use an address of this host, "
        "e.g. tcp://127.0.0.1:0 or tcp://0.0.0.0:7000"
    )
