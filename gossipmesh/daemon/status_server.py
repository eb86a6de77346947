"""The node's HTTP endpoint: ``/metrics`` (Prometheus), ``/healthz`` (liveness) and ``/readyz``
(readiness), on one port, served from a background thread.

Whoever reaches the port can hold connections open, so the server holds at most
``MAX_CONNECTIONS`` at once (one more is closed at once, counted in ``refused``) and gives each
``TIMEOUT_S`` to send its request; bind it to an address only the scraper and the kubelet reach
(``--metrics-host``) where the network is not trusted. ``/healthz`` fails once the network
thread has died, so an orchestrator restarts a node that would otherwise train alone.
"""

from __future__ import annotations

import errno
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gossipmesh.daemon.metrics import NodeMetrics

MAX_CONNECTIONS = 16
TIMEOUT_S = 5.0


class StatusServerError(OSError):
    """The endpoint could not start; the message says which flag to change."""


class StatusServer:
    """Serves ``metrics`` on ``host:port`` until :meth:`close`."""

    def __init__(
        self,
        metrics: NodeMetrics,
        port: int,
        host: str = "0.0.0.0",
        *,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        handler = type("Handler", (_Handler,), {"metrics": metrics})
        try:
            self._server = _BoundedServer((host, port), handler, max_connections)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StatusServerError(
                    f"metrics port {port} is in use; pass another --metrics-port"
                ) from None
            raise StatusServerError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror}; pass a --metrics-host of this "
                "host (e.g. 127.0.0.1 or 0.0.0.0)"
            ) from None
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="status-http", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> int:
        """Connections closed unserved because ``max_connections`` were open."""
        return self._server.refused

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them."""

    daemon_threads = True
    request_queue_size = 128  # a burst of connections is taken in and refused, not left to retry

    def __init__(self, address: tuple[str, int], handler: type[_Handler], max_connections: int) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up or times out is not an error worth a traceback."""


class _Handler(BaseHTTPRequestHandler):
    metrics: NodeMetrics
    timeout = TIMEOUT_S  # for the request line, headers and each write

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._answer(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
        elif path in ("/healthz", "/readyz"):
            ok = _live(self.metrics) if path == "/healthz" else self.metrics.ready()
            self._answer(200 if ok else 503, b"ok\n" if ok else b"not ok\n", "text/plain")
        else:
            self._answer(404, b"try /metrics, /healthz or /readyz\n", "text/plain")

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Scrapes every few seconds would flood the node's log: stay quiet."""


def _live(metrics: NodeMetrics) -> bool:
    """The daemon's loop makes progress and its network thread runs."""
    network_up = metrics.peer is None or metrics.peer.transport.failure is None
    return metrics.alive() and network_up
