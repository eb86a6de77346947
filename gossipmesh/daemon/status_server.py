"""The node's HTTP endpoint: ``/metrics`` (Prometheus), ``/healthz`` (liveness) and ``/readyz``
(readiness), on one port, served from a background thread."""

from __future__ import annotations

import errno
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gossipmesh.daemon.metrics import NodeMetrics


class StatusServerError(OSError):
    """The endpoint could not start; the message says which flag to change."""


class StatusServer:
    """Serves ``metrics`` on ``host:port`` until :meth:`close`."""

    def __init__(self, metrics: NodeMetrics, port: int, host: str = "0.0.0.0") -> None:
        handler = type("Handler", (_Handler,), {"metrics": metrics})
        try:
            self._server = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StatusServerError(
                    f"metrics port {port} is in use; pass another --metrics-port"
                ) from None
            raise StatusServerError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="status-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    metrics: NodeMetrics

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._answer(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
        elif path in ("/healthz", "/readyz"):
            ok = self.metrics.alive() if path == "/healthz" else self.metrics.ready()
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
