"""What an attacker sends, for the hardening tests and the live fuzzer: raw CURVE sockets with a
key of its choosing, forged beacons, forged member records, and a look at a process's memory."""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import msgpack
import zmq
from helpers import wait_until

from p2p import Peer, Transport
from p2p.membership.beacon import BEACON_VERSION
from p2p.membership.table import Member, Status
from p2p.security.curve import NodeKeys, configure_client


@contextmanager
def dealers(
    routing_ids: Sequence[str], address: str, own: NodeKeys | None = None, server_key: bytes = b""
) -> Iterator[list[zmq.Socket[bytes]]]:
    """Bare DEALERs (CURVE with ``own`` keys, if given), one claiming each of ``routing_ids``:
    they send whatever a test wants (what they queued gets a second to leave at the end)."""
    context = zmq.Context()
    dealers = []
    for routing_id in routing_ids:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, routing_id.encode())
        dealer.setsockopt(zmq.LINGER, 1000)
        if own is not None:
            configure_client(dealer, own, server_key)
        dealer.connect(address)
        dealers.append(dealer)
    try:
        yield dealers
    finally:
        context.destroy(linger=1000)


def connect(sender: Transport, address: str, receiver: Transport, key: str | None = None) -> None:
    """Send harmless gossip from ``sender`` until ``receiver`` hears it: the connection is up
    (what a transport sends before its connection is up is dropped)."""
    heard = receiver.stats.messages_received
    meta = {"updates": [], "reply_to": sender.address}
    for _ in range(100):
        sender.send(address, "gossip", 0, meta=meta, key=key)
        if wait_until(lambda: receiver.stats.messages_received > heard, 0.1):
            return
    raise AssertionError(f"{sender.node_id} could not reach {address}")


# a ZMTP 3.0 greeting from a CURVE client: what opens a handshake, which then needs a HELLO
CURVE_GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + bytes(32)


@contextmanager
def half_open(address: str, sources: Iterable[str], greeting: bytes = CURVE_GREETING) -> Iterator[int]:
    """TCP connections to ``address``, one from each of ``sources`` (local addresses, e.g.
    127.0.0.2), that send ``greeting`` and nothing more; yields how many opened (this process
    may run out of descriptors first), closes them at the end."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    connections = []
    for source in sources:
        try:
            connection = socket.socket()
        except OSError:  # (this process's descriptors)
            break
        connections.append(connection)
        try:
            connection.bind((source, 0))
            connection.connect((host, int(port)))
            connection.sendall(greeting)
        except OSError:  # (the node shut it at once: it counts all the same)
            pass
    try:
        yield len(connections)
    finally:
        for connection in connections:
            connection.close()


def forge_beacon(port: int, *, node_id: str, address: str, key: str = "", mesh: str = "gossipmesh") -> None:
    """One UDP beacon to 127.0.0.1:``port`` saying whatever the caller likes."""
    beacon = msgpack.packb({"v": BEACON_VERSION, "mesh": mesh, "id": node_id, "address": address, "key": key})
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.sendto(beacon, ("127.0.0.1", port))


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.1", 0))
        return int(udp.getsockname()[1])


def record_of(peer: Peer, **changes: object) -> list[object]:
    """``peer``'s own member record as it would gossip it, with ``changes`` (a forgery)."""
    me: Member = peer.membership._me
    fields = {**me.__dict__, **changes}
    return Member(**fields).to_wire()  # type: ignore[arg-type]


def fake_members(count: int, prefix: str = "fake", keys: Sequence[str] = ()) -> list[list[object]]:
    """Records of ``count`` live members that do not exist, the i-th with ``keys[i]`` (no key if
    ``keys`` is empty). Their addresses are on 127.0.0.254, where no test binds: on 127.0.0.1 a
    made-up port could be a real node's, whose table then refuses the record as a conflict."""
    return [
        Member(f"{prefix}-{i}", f"tcp://127.0.0.254:{10_000 + i}", i + 1, 0, Status.ALIVE, key=key).to_wire()
        for i, key in enumerate(keys or [""] * count)
    ]


def trust_new_keys(trusted: Path, count: int) -> list[str]:
    """Put ``count`` new public keys (z85) in the folder ``trusted``: keys an insider could give
    the members it makes up (a member's key is one no other live member holds)."""
    keys = [zmq.curve_keypair()[0].decode() for _ in range(count)]
    for i, key in enumerate(keys):
        (trusted / f"made-up-{i}.key").write_text(f'metadata\ncurve\n    public-key = "{key}"\n')
    return keys


def resident_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process now (VmRSS)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024
