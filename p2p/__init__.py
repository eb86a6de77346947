"""Everything that touches the network: wire format, transport, membership. No torch here."""

from p2p.address import AddressError
from p2p.endpoint.local_rank import LocalRankPeer
from p2p.endpoint.peer import Peer
from p2p.transport.network_thread import Transport, TransportError
from p2p.transport.stats import TransportStats
from p2p.wire import Limits, Message, WireError, decode, encode

__all__ = [
    "AddressError",
    "Limits",
    "LocalRankPeer",
    "Message",
    "Peer",
    "Transport",
    "TransportError",
    "TransportStats",
    "WireError",
    "decode",
    "encode",
]
