"""Node endpoints: parsing, validation and the errors a user sees for a bad one."""

from __future__ import annotations

import random
import re
import socket
import threading
import time
from contextlib import ExitStack
from pathlib import Path

# a host: [IPv6], or an IPv4 address or DNS name (letters, digits, '.', '-', '_'), or * (any)
_TCP = re.compile(
    r"(?:tcp://)?(?P<host>\[[0-9a-fA-F:.]+\]|\*|[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9_])?)"
    r":(?P<port>\d{1,5})\Z"
)
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
_WILDCARDS = {"*", "0.0.0.0", "[::]"}
OUTGOING_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")  # the kernel's source ports
FIRST_PICKED_PORT = 10_000  # free_ports picks from here up to the first of those
PICKED_PORT_HELD_S = 600.0  # free_ports does not give a port out again for this long
# the address of a node that accepts no connection (``--no-listen``): it is reached over the
# connections it opened (``p2p.transport.connections``)
INBOUND = "inbound://"


class AddressError(ValueError):
    """An endpoint or node id that cannot be used; the message says what to pass instead."""


def default_name() -> str:
    """This host's name, made valid as a node id (and a key file name)."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:40]
    return host.strip("-.") or "node"


def parse_endpoint(text: str) -> str:
    """``HOST:PORT`` or ``tcp://HOST:PORT`` -> ``tcp://HOST:PORT`` (port 0 means any free port)."""
    match = _TCP.match(text.strip())
    if match is None or int(match["port"]) > 65535:
        raise AddressError(
            f"bad address {text!r}: expected tcp://HOST:PORT with a port in 0..65535, "
            "e.g. tcp://127.0.0.1:7000 (port 0 picks a free one)"
        )
    return f"tcp://{match['host']}:{int(match['port'])}"


def inbound_address(node_id: str) -> str:
    """The address a node that does not listen goes by: its id, under ``inbound://``."""
    return INBOUND + check_node_id(node_id)


def inbound_id(address: str) -> str | None:
    """The node id of an ``inbound://`` address; None for an address one can dial."""
    return address[len(INBOUND) :] if address.startswith(INBOUND) else None


def parse_member_address(text: str, node_id: str) -> str:
    """A member record's address: a dialable endpoint, or the member's own ``inbound://`` id."""
    if text.startswith(INBOUND):
        if text != inbound_address(node_id):
            raise AddressError(f"an inbound-only member goes by {inbound_address(node_id)}, not {text!r}")
        return text
    return parse_endpoint(text)


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


_picked: dict[int, float] = {}  # port free_ports gave out -> when (time.monotonic())
_picked_lock = threading.Lock()


def free_ports(count: int, block: int = 1) -> list[int]:
    """Ports free on 127.0.0.1 right now, all distinct (held together while picked); with
    ``block``, each the first of that many consecutive free ports (a machine's local ranks).
    They are drawn below the kernel's range for outgoing connections: a port the kernel gave
    out could be taken by a connection's source port before its node binds it. Nor is a port
    given out again by this process for ``PICKED_PORT_HELD_S``: two picks made before either's
    ports are bound (a machine's ranks, then its collective's) would otherwise meet."""
    candidates = range(FIRST_PICKED_PORT, max(_outgoing_ports_start(), FIRST_PICKED_PORT + 1000) - block)
    with _picked_lock:
        now = time.monotonic()
        for port in [p for p, at in _picked.items() if now - at > PICKED_PORT_HELD_S]:
            del _picked[port]
        bases = _pick(candidates, count, block)
        _picked.update((base + offset, now) for base in bases for offset in range(block))
        return bases


def _pick(candidates: range, count: int, block: int) -> list[int]:
    with ExitStack() as stack:
        bases: list[int] = []
        for _ in range(50 * count):
            if len(bases) == count:
                return bases
            base = random.choice(candidates)
            if any(base + offset in _picked for offset in range(block)):
                continue
            held: list[socket.socket] = []
            try:
                for offset in range(block):
                    held.append(socket.socket())
                    held[-1].bind(("127.0.0.1", base + offset))
            except OSError:
                for sock in held:
                    sock.close()
                continue
            for sock in held:
                stack.enter_context(sock)
            bases.append(base)
        if len(bases) == count:
            return bases
    raise OSError(f"could not find {count} blocks of {block} free ports on 127.0.0.1")


def _outgoing_ports_start() -> int:
    """The first port of the kernel's ephemeral range (Linux reads it from /proc; elsewhere
    IANA's 49152)."""
    try:
        return int(OUTGOING_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152
