"""LAN beacon: zero-configuration discovery by UDP broadcast on the local segment.

Every node with the beacon on says "mesh NAME, node ID, dial me at ADDRESS (with KEY)" on the broadcast
address of each of its interfaces, often while it is alone and rarely once it has joined, and
listens on the same port. A beacon from a node it does not know becomes a contact: the node
swaps member tables with it, which joins two lone nodes, or merges two meshes of the same name
that started apart. Beacons of other mesh names are ignored; nothing in a beacon is trusted
beyond an address to try.

Beacons are plain UDP, never encrypted or authenticated (CURVE covers ZeroMQ only): anyone on
the segment can read them and forge them. A forged beacon can do no more than make a node try an
address: on a secure node the CURVE key it names is used only if it is in the trusted folder, so
the handshake fails unless the real holder of that key answers there; and a member's record only
ever comes from the member table exchange that follows, over CURVE.
"""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
from collections.abc import Callable

import msgpack

from p2p.address import AddressError, check_node_id, parse_endpoint

BEACON_VERSION = 1
MAX_BEACON_BYTES = 512
ALONE_INTERVAL_S = 1.0
JOINED_INTERVAL_S = 10.0
_SIOCGIFFLAGS = 0x8913
_SIOCGIFBRDADDR = 0x8919
_IFF_UP, _IFF_BROADCAST = 0x1, 0x2


class Beacon:
    """A transport service announcing this node and reporting the nodes it hears.

    Args:
        port: the UDP port every node of the mesh beacons on.
        mesh: the mesh name; beacons of other names are ignored.
        node_id / address / key: what this node announces (``address`` read when announcing;
            ``key``: its CURVE public key, "" when insecure).
        on_contact: called on the network thread with (id, address, key) of a node heard.
        alone: whether this node has no other member yet (it then beacons more often).
    """

    kinds: frozenset[str] = frozenset()

    def __init__(
        self,
        port: int,
        *,
        mesh: str,
        node_id: Callable[[], str],
        address: Callable[[], str],
        key: str,
        on_contact: Callable[[str, str, str], None],
        alone: Callable[[], bool],
    ) -> None:
        self.port = port
        self.mesh = mesh
        self._node_id = node_id
        self._address = address
        self._key = key
        self._on_contact = on_contact
        self._alone = alone
        self.heard = 0
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        self.socket.setblocking(False)
        self.socket.bind(("", port))
        self._next = 0.0

    def on_message(self, message: object) -> None:  # beacons do not come over ZeroMQ
        raise AssertionError("the beacon claims no message kinds")

    def on_tick(self, now: float) -> float:
        if now >= self._next:
            self._announce()
            self._next = now + (ALONE_INTERVAL_S if self._alone() else JOINED_INTERVAL_S)
        return self._next

    def on_readable(self) -> None:
        """Read every waiting beacon (network thread)."""
        while True:
            try:
                data, _ = self.socket.recvfrom(MAX_BEACON_BYTES + 1)
            except BlockingIOError:
                return
            contact = parse_beacon(data, self.mesh)
            if contact is not None and contact[0] != self._node_id():
                self.heard += 1
                self._on_contact(*contact)

    def close(self) -> None:
        self.socket.close()

    def _announce(self) -> None:
        beacon = msgpack.packb(
            {
                "v": BEACON_VERSION,
                "mesh": self.mesh,
                "id": self._node_id(),
                "address": self._address(),
                "key": self._key,
            }
        )
        for target in broadcast_addresses():
            with contextlib.suppress(OSError):  # an interface without a route: try the others
                self.socket.sendto(beacon, (target, self.port))


def parse_beacon(data: bytes, mesh: str) -> tuple[str, str, str] | None:
    """(node id, address, key) from a beacon of ``mesh``, or None for anything else."""
    if len(data) > MAX_BEACON_BYTES:
        return None
    try:
        beacon = msgpack.unpackb(data, raw=False, max_str_len=MAX_BEACON_BYTES, max_bin_len=0)
        if not isinstance(beacon, dict) or beacon.get("v") != BEACON_VERSION or beacon.get("mesh") != mesh:
            return None
        key = beacon.get("key", "")
        if not isinstance(key, str) or len(key) not in (0, 40):
            return None
        return check_node_id(str(beacon["id"])), parse_endpoint(str(beacon["address"])), key
    except (ValueError, KeyError, AddressError, msgpack.UnpackException):
        return None


def broadcast_addresses() -> list[str]:
    """The broadcast address of every interface that is up and can broadcast (Linux), or the
    limited broadcast address where interfaces cannot be listed."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(probe.fileno(), _SIOCGIFFLAGS, request)[16:18])[0]
                if flags & _IFF_UP and flags & _IFF_BROADCAST:
                    found.append(
                        socket.inet_ntoa(fcntl.ioctl(probe.fileno(), _SIOCGIFBRDADDR, request)[20:24])
                    )
            except OSError:
                continue
    return found or ["255.255.255.255"]
