"""A node's network endpoint: the transport plus its membership.

This is the object gossip algorithms talk to (``gossip.network.PeerNetwork``): peers are named by
id, the membership view says who is a member in each round, and sends never block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from p2p.endpoint.local_rank import encode_view
from p2p.endpoint.shared import Endpoint
from p2p.membership.beacon import Beacon
from p2p.membership.protocol import NOT_YET, PROFILES, DetectorProfile, Membership
from p2p.security.curve import Curve
from p2p.transport.network_thread import Transport, TransportError
from p2p.wire import Limits

#: how long a node whose key every bootstrap address refused waits before it gives up (a key
#: copied into their --trusted folder meanwhile still lets it in, at its next join attempt)
REFUSED_PATIENCE_S = 5.0


class Peer(Endpoint):
    """Args are those of :class:`~p2p.transport.network_thread.Transport`, plus ``bootstrap``
    (addresses of live members to join through; none: start a mesh of one), those of
    :class:`~p2p.membership.protocol.Membership` (``profile``, ``clock``, ``first_round``), and
    ``beacon_port`` / ``mesh_name`` for discovery by LAN beacon (0: off), ``ranks`` (the data
    addresses of this machine's local ranks 1, 2...: see ``p2p.endpoint.local_rank``).
    ``listen=None``: a node that accepts no connection (see ``p2p.transport.network_thread``); it
    joins through ``bootstrap``. ``curve``: keys for CURVE on every socket (see
    ``p2p.security.curve``); None runs insecure. ``max_send_bytes_per_s``: a cap on what the node
    sends (``p2p.transport.send_cap``). ``streams``: the connections a large message to a peer is
    spread over (``p2p.transport.connections``)."""

    def __init__(
        self,
        node_id: str,
        listen: str | None,
        bootstrap: Iterable[str] = (),
        *,
        advertise: str | None = None,
        inbox_kinds: Iterable[str] | None = None,
        limits: Limits = Limits(),
        linger_s: float = 1.0,
        profile: DetectorProfile = PROFILES["local"],
        clock: Callable[[], float] = time.monotonic,
        first_round: int = 0,
        beacon_port: int = 0,
        mesh_name: str = "gossipmesh",
        curve: Curve | None = None,
        max_send_bytes_per_s: float | None = None,
        ranks: Sequence[str] = (),
        streams: int = 1,
    ) -> None:
        super().__init__(
            Transport(
                node_id,
                listen,
                advertise=advertise,
                inbox_kinds=inbox_kinds,
                limits=limits,
                linger_s=linger_s,
                curve=curve,
                max_send_bytes_per_s=max_send_bytes_per_s,
                streams=streams,
            )
        )
        if listen is None and (beacon_port or not bootstrap):
            raise TransportError(
                "a node that does not listen can only join through bootstrap= (no member could "
                "reach it from a beacon, and it cannot start a mesh)"
            )
        self.bootstrap = list(bootstrap)
        self.membership = Membership(
            self.transport,
            self.bootstrap,
            profile=profile,
            clock=clock,
            first_round=first_round,
            solo=not beacon_port,
            ranks=ranks,
        )
        self.transport.add_service(self.membership)
        self.beacon: Beacon | None = None
        if beacon_port:
            self.beacon = Beacon(
                beacon_port,
                mesh=mesh_name,
                node_id=lambda: self.transport.node_id,
                address=lambda: self.transport.address,
                key=curve.keys.public.decode() if curve is not None else "",
                on_contact=self.membership.add_contact,
                alone=self.membership.alone,
            )
            self.transport.add_service(self.beacon)
            self.transport.add_reader(self.beacon.socket.fileno(), self.beacon.on_readable)
        self._left = False

    def start(self) -> str:
        """Bind and start networking (and joining); returns the address peers dial."""
        return self.transport.start()

    def wait_ready(
        self,
        timeout: float,
        *,
        expect: int = 1,
        round: int | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        """Block until this node has joined a mesh (any mesh, with no bootstrap) of at least
        ``expect`` members (taking part in gossip ``round``, this node among them, when given:
        its own :meth:`start_at_round` is applied on the network thread), or ``cancelled()``;
        raise TransportError after ``timeout``."""
        deadline = time.monotonic() + timeout
        refused_since = None  # when every bootstrap address had refused this node's key
        while not self._ready(expect, round):
            self.transport.check_running()
            if cancelled():
                return
            now = time.monotonic()
            if refused_since is None and self._refused_everywhere():
                refused_since = now
            if now >= deadline or (refused_since is not None and now - refused_since >= REFUSED_PATIENCE_S):
                raise TransportError(self._not_ready(timeout, expect, round))
            if self.membership.joined.is_set():  # (a set event returns at once: no busy loop,
                time.sleep(0.05)  # which starved the network and ZAP threads of the GIL)
            else:
                self.membership.joined.wait(0.05)

    def _ready(self, expect: int, round: int | None) -> bool:
        if not self.membership.joined.is_set():
            return False
        members = self.members(round)
        return len(members) >= expect and (round is None or self.node_id in members)

    def members(self, round: int | None = None) -> frozenset[str]:
        return self.membership.members(round)

    def not_listening(self) -> frozenset[str]:
        return self.membership.not_listening

    def export_view(self) -> bytes:
        """This node's member view for its other local ranks (``p2p.endpoint.local_rank``)."""
        return encode_view(self.membership.view)

    def send(
        self,
        to: str,
        kind: str,
        round: int,
        tensors: Sequence[np.ndarray] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.transport.check_running()
        contact = self.membership.contact(to)
        if contact is None:
            self.stats.drop("unknown_peer")
            return
        address, key = contact
        self.transport.send(address, kind, round, tensors, meta, key=key or None, member=True)

    def backlog(self, to: str) -> int:
        contact = self.membership.contact(to)
        return 0 if contact is None else self.transport.backlog(contact[0])

    def missed(self, node_id: str) -> None:
        """``node_id`` sent nothing when expected: have the failure detector probe it now."""
        self.membership.probe_soon(node_id)

    def start_at_round(self, first_round: int) -> None:
        """Announce the first gossip round this late joiner takes part in."""
        self.membership.start_at_round(first_round)

    def leave(self, after_round: int = -1) -> None:
        """Tell every member this node takes part in no gossip round after ``after_round``."""
        if self.transport.address and not self._left:
            self.membership.leave(after_round)
        self._left = True

    def close(self) -> None:
        """Leave (if not done yet), then stop networking (bounded by the linger time)."""
        self.leave()
        self.transport.close()
        if self.beacon is not None:
            self.beacon.close()

    def _refused_everywhere(self) -> bool:
        """Whether every bootstrap address refused this node's key before it joined."""
        refused = dict(self.transport.connections.refused)  # (a copy: the network thread counts)
        return (
            bool(self.bootstrap)
            and not self.membership.joined.is_set()
            and set(self.bootstrap) <= refused.keys()
        )

    def _refusals(self) -> str | None:
        """Why joining failed when peers refused this node's key (for people), or None."""
        refused, curve = dict(self.transport.connections.refused), self.transport.curve
        if not refused or curve is None:
            return None
        where = ", ".join(sorted(refused))
        public = curve.keys.file.with_suffix(".key") if curve.keys.file else "its public .key"
        return (
            f"{sum(refused.values())} handshakes refused for untrusted keys: {where} does not trust "
            f"this node's key {curve.keys.public.decode()}; copy {public} into the trusted= folder there"
        )

    def _not_ready(self, timeout: float, expect: int, round: int | None) -> str:
        if not self.membership.joined.is_set():
            refusals = self._refusals()
            if refusals is not None:
                return f"could not join: {refusals}"
            reason = self.membership.join_error or "no member answered"
            where = (
                ", ".join(self.bootstrap) or f"beacons on UDP port {self.beacon.port if self.beacon else 0}"
            )
            return (
                f"could not join through {where} within {timeout:g} s ({reason}); "
                "check that a node runs there and is reachable, or raise timeout="
            )
        if round is None:
            what = "joined"
        elif round >= NOT_YET - 1:  # (a joiner waits for the members that announced a first round)
            what = "were ready to train"
        else:
            what = f"were ready to train round {round}"
        return (
            f"only {len(self.members(round))} of the {expect} expected members {what} within "
            f"{timeout:g} s; start the others, lower expect=, or raise timeout="
        )
