"""What every network endpoint of a node shares: its transport, named and counted, and the parts
of ``gossip.network.PeerNetwork`` that do not depend on membership."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection

from p2p.endpoint.threads import start_thread
from p2p.transport.network_thread import Transport
from p2p.transport.stats import TransportStats
from p2p.wire import Message


class Endpoint:
    """A node's transport (``p2p.Peer``'s, or a local rank's: ``p2p.LocalRankPeer``)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    @property
    def node_id(self) -> str:
        return self.transport.node_id

    @property
    def address(self) -> str:
        return self.transport.address

    @property
    def stats(self) -> TransportStats:
        return self.transport.stats

    def now(self) -> float:
        return time.monotonic()

    def recv(self, timeout: float, kinds: Collection[str] | None = None) -> Message | None:
        """The oldest message of ``kinds``; raises TransportError once the network thread has
        died, so training never goes on alone unawares."""
        self.transport.check_running()
        return self.transport.recv(timeout, kinds)

    def wire_bytes(self, nbytes: int) -> int:
        return nbytes

    def start_background(self, name: str, target: Callable[[], None]) -> threading.Thread:
        return start_thread(name, target)

    def take_pieces(self, kinds: Collection[str]) -> None:
        self.transport.take_pieces(kinds)
