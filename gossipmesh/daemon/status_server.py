"""The node's HTTP endpoint: ``/metrics`` (Prometheus), ``/healthz`` (liveness) and ``/readyz``
(readiness), on one port, served from a background thread.

Whoever reaches the port can open connections and send slowly, so one thread serves every
connection from a selector (a slow client holds no thread): each connection has
``REQUEST_DEADLINE_S`` in all to send its request and take the answer, a client address holds
at most ``MAX_PER_CLIENT`` connections and all together at most ``MAX_CONNECTIONS``; a new
connection beyond either bound takes the place of the oldest one (of its own address, or, when
all are taken, of any). So a probe is answered as soon as its request is in, whatever others
hold: one address can only push out its own connections. It binds to
127.0.0.1 unless ``--metrics-host`` says otherwise. ``/healthz`` fails once the network thread
or the CURVE authenticator has died, so an orchestrator restarts a node that would otherwise
train alone.
"""

from __future__ import annotations

import errno
import selectors
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gossipmesh.daemon.metrics import NodeMetrics

MAX_CONNECTIONS = 64  # open at once, all clients together
MAX_PER_CLIENT = 8  # open at once from one address
REQUEST_DEADLINE_S = 5.0  # for the whole request and its answer, however the bytes trickle in
MAX_REQUEST_BYTES = 8192  # a request line and headers; longer ones are closed unanswered
_READ_BYTES = 4096


class StatusServerError(OSError):
    """The endpoint could not start; the message says which flag to change."""


@dataclass
class _Connection:
    sock: socket.socket
    client: str
    deadline: float
    request: bytes = b""
    answer: bytes = field(default=b"")  # what is left to send, once the request is in


class StatusServer:
    """Serves ``metrics`` on ``host:port`` until :meth:`close`."""

    def __init__(
        self,
        metrics: NodeMetrics,
        port: int,
        host: str = "127.0.0.1",
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_per_client: int = MAX_PER_CLIENT,
    ) -> None:
        self.metrics = metrics
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.evicted = 0  # connections closed unanswered to make room for a newer one
        self.expired = 0  # connections closed unanswered at their deadline
        try:
            self._listener = socket.create_server((host, port), backlog=128)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                message = f"metrics port {port} is in use; pass another --metrics-port"
                raise StatusServerError(message) from None
            raise StatusServerError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror}; pass a --metrics-host of this "
                "host (e.g. 127.0.0.1 or 0.0.0.0)"
            ) from None
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._open: dict[socket.socket, _Connection] = {}  # oldest first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="status-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for connection in list(self._open.values()):
            self._drop(connection)
        self._selector.close()
        self._listener.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, events in self._selector.select(timeout=0.1):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    assert isinstance(key.fileobj, socket.socket)
                    connection = self._open.get(key.fileobj)
                    if connection is not None:
                        self._serve_one(connection, events)
            now = time.monotonic()
            for connection in [c for c in self._open.values() if c.deadline <= now]:
                self.expired += 1
                self._drop(connection)

    def _accept(self) -> None:
        try:
            sock, address = self._listener.accept()
        except OSError:  # gone before it was taken in, or no descriptor left: the next one
            return
        client = str(address[0])
        per_client = Counter(c.client for c in self._open.values())
        for crowd, bound in ((client, self.max_per_client), (None, self.max_connections)):
            count = per_client[client] if crowd is not None else len(self._open)
            if count >= bound:
                oldest = next(c for c in self._open.values() if crowd is None or c.client == crowd)
                self.evicted += 1
                self._drop(oldest)
                per_client[oldest.client] -= 1
        sock.setblocking(False)
        self._open[sock] = _Connection(sock, client, time.monotonic() + REQUEST_DEADLINE_S)
        self._selector.register(sock, selectors.EVENT_READ)

    def _serve_one(self, connection: _Connection, events: int) -> None:
        try:
            if events & selectors.EVENT_READ and not connection.answer:
                data = connection.sock.recv(_READ_BYTES)
                connection.request += data
                if not data or len(connection.request) > MAX_REQUEST_BYTES:
                    self._drop(connection)
                    return
                if b"\r\n\r\n" not in connection.request and b"\n\n" not in connection.request:
                    return
                connection.answer = self._answer(connection.request)
                self._selector.modify(connection.sock, selectors.EVENT_WRITE)
            sent = connection.sock.send(connection.answer)
            connection.answer = connection.answer[sent:]
            if not connection.answer:
                self._drop(connection)
        except BlockingIOError:
            return
        except OSError:  # the client hung up: not an error worth a traceback
            self._drop(connection)

    def _answer(self, request: bytes) -> bytes:
        """The whole HTTP/1.0 answer to ``request`` (the connection closes after it)."""
        method, _, rest = request.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0].decode("ascii", "replace")
        if method != b"GET":
            return _http(405, b"only GET\n", "text/plain")
        if path == "/metrics":
            return _http(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
        if path in ("/healthz", "/readyz"):
            ok = _live(self.metrics) if path == "/healthz" else self.metrics.ready()
            return _http(200 if ok else 503, b"ok\n" if ok else b"not ok\n", "text/plain")
        return _http(404, b"try /metrics, /healthz or /readyz\n", "text/plain")

    def _drop(self, connection: _Connection) -> None:
        del self._open[connection.sock]
        self._selector.unregister(connection.sock)
        connection.sock.close()


def _http(status: int, body: bytes, content_type: str) -> bytes:
    reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}[status]
    head = (
        f"HTTP/1.0 {status} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def _live(metrics: NodeMetrics) -> bool:
    """The daemon's loop makes progress, and its network thread (with CURVE, its authenticator
    too) runs."""
    network_up = metrics.peer is None or metrics.peer.transport.failure is None
    return metrics.alive() and network_up
