"""Node endpoints: parsing, validation and the errors a user sees for a bad one."""

from __future__ import annotations

import re
import socket
from contextlib import ExitStack

# a host: [IPv6], or an IPv4 address or DNS name (letters, digits, '.', '-', '_'), or * (any)
_TCP = re.compile(
    r"(?:tcp://)?(?P<host>\[[0-9a-fA-F:.]+\]|\*|[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9_])?)"
    r":(?P<port>\d{1,5})\Z"
)
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
_WILDCARDS = {"*", "0.0.0.0", "[::]"}


class AddressError(ValueError):
    """An endpoint or node id that cannot be used; the message says what to pass instead."""


def parse_endpoint(text: str) -> str:
    """``HOST:PORT`` or ``tcp://HOST:PORT`` -> ``tcp://HOST:PORT`` (port 0 means any free port)."""
    match = _TCP.match(text.strip())
    if match is None or int(match["port"]) > 65535:
        raise AddressError(
            f"bad address {text!r}: expected tcp://HOST:PORT with a port in 0..65535, "
            "e.g. tcp://127.0.0.1:7000 (port 0 picks a free one)"
        )
    return f"tcp://{match['host']}:{int(match['port'])}"


def bind_form(endpoint: str) -> str:
    """The form ZeroMQ binds: port 0 becomes ``*`` (ZeroMQ's 'any free port')."""
    host, port = split_endpoint(endpoint)
    return f"tcp://{host}:{'*' if port == 0 else port}"


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = parse_endpoint(endpoint).removeprefix("tcp://").rpartition(":")
    return host, int(port)


def advertised(bound: str) -> str:
    """The address peers should dial for a socket bound at ``bound`` (wildcards resolved)."""
    host, port = split_endpoint(bound)
    if host in _WILDCARDS:
        host = socket.gethostbyname(socket.gethostname())
    return f"tcp://{host}:{port}"


def check_node_id(node_id: str) -> str:
    if not _NODE_ID.match(node_id):
        raise AddressError(
            f"bad node id {node_id!r}: use 1-64 letters, digits, '.', '_' or '-', starting with "
            "a letter or digit"
        )
    return node_id


def resolve_all(endpoint: str) -> list[str]:
    """Every numeric address ``endpoint``'s host resolves to (a DNS name such as a Kubernetes
    headless Service may stand for many nodes), in the form peers advertise."""
    host, port = split_endpoint(endpoint)
    if host.startswith("["):
        return [f"tcp://{host}:{port}"]
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise AddressError(f"cannot resolve {host!r} in {endpoint}: {exc.strerror}") from None
    return sorted({f"tcp://{info[4][0]}:{port}" for info in infos})


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 right now (held together while picked, so all distinct)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
