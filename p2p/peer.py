"""A node's network endpoint: the transport plus its membership view.

This is the object gossip algorithms talk to (``gossip.network.PeerNetwork``): peers are named by
id, the membership view says who is live, and sends never block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from p2p.membership import StaticMembership
from p2p.transport import Transport, TransportError, TransportStats
from p2p.wire import Limits, Message


class Peer:
    """Args are those of :class:`~p2p.transport.Transport`, plus ``bootstrap``: the addresses of
    the other nodes to say hello to (this node's own address may be among them)."""

    def __init__(
        self,
        node_id: str,
        listen: str,
        bootstrap: Iterable[str] = (),
        *,
        advertise: str | None = None,
        inbox_kinds: Iterable[str] | None = None,
        limits: Limits = Limits(),
        linger_s: float = 1.0,
    ) -> None:
        self.transport = Transport(
            node_id, listen, advertise=advertise, inbox_kinds=inbox_kinds, limits=limits, linger_s=linger_s
        )
        self.membership = StaticMembership(self.transport, bootstrap)
        self.transport.add_service(self.membership)
        self._left = False

    @property
    def node_id(self) -> str:
        return self.transport.node_id

    @property
    def address(self) -> str:
        return self.transport.address

    @property
    def stats(self) -> TransportStats:
        return self.transport.stats

    def start(self) -> str:
        """Bind and start networking; returns the address peers dial."""
        return self.transport.start()

    def wait_ready(self, timeout: float, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Block until every bootstrap peer has answered (or ``cancelled()``), else raise."""
        deadline = time.monotonic() + timeout
        while not self.membership.ready.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if cancelled():
                return
            if time.monotonic() >= deadline:
                missing = ", ".join(self.membership.missing())
                raise TransportError(
                    f"no answer within {timeout:g} s from {missing}; check that those nodes are "
                    "running and reachable, or raise --startup-timeout"
                )

    def members(self, round: int | None = None) -> frozenset[str]:
        return self.membership.members(round)

    def send(
        self,
        to: str,
        kind: str,
        round: int,
        tensors: Sequence[np.ndarray] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        address = self.membership.address_of(to)
        if address is None:
            self.stats.dropped["unknown_peer"] += 1
            return
        self.transport.send(address, kind, round, tensors, meta)

    def recv(self, timeout: float, kinds: Collection[str] | None = None) -> Message | None:
        return self.transport.recv(timeout, kinds)

    def leave(self, after_round: int = -1) -> None:
        """Tell every member this node takes part in no gossip round after ``after_round``."""
        if self.transport.address and not self._left:
            self.membership.leave(after_round)
        self._left = True

    def close(self) -> None:
        """Leave (if not done yet), then stop networking (bounded by the linger time)."""
        self.leave()
        self.transport.close()
