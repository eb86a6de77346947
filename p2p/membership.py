"""Static membership: the members are this node and every bootstrap peer that said hello.

Runs on the network thread as a transport service. Each node says ``hello`` (its id, the address
to dial it at, and the ids it has heard from) to every bootstrap address until each of them has
answered and knows it; then the node is *ready*, and keeps a slow heartbeat.

A ``leave`` names the last round its sender took part in. The view answers "who is a member in
round r": a node that left after round R is still one for rounds up to R (it sent its messages
for them) and is gone from R + 1, so nodes that learn of the leave at slightly different times
still agree on every round's graph. Serverless discovery and failure detection replace this
service in a later step; the view it offers (``members``) stays the same.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from p2p.address import AddressError, parse_endpoint, resolve
from p2p.transport import Transport
from p2p.wire import Message

HELLO_INTERVAL_S = 0.2
CONNECT_GRACE_S = 0.02  # a new connection drops what is sent before it is up: dial, then speak
HEARTBEAT_INTERVAL_S = 1.0


class StaticMembership:
    """The membership view of one node; mutated only on the network thread."""

    kinds = frozenset({"hello", "leave"})

    def __init__(self, transport: Transport, bootstrap: Iterable[str]) -> None:
        self._transport = transport
        self._bootstrap = {resolve(address) for address in bootstrap}
        self._addresses: dict[str, str] = {}  # peer id -> address to dial it at
        self._knows_me: set[str] = set()
        self._departed: dict[str, tuple[int, int]] = {}  # peer id -> (session, last round)
        self._members: frozenset[str] = frozenset({transport.node_id})
        self._lingering: tuple[tuple[str, int], ...] = ()  # (departed id, last round) snapshot
        self._dialed = False
        self.ready = threading.Event()

    # -- any thread --------------------------------------------------------------------------

    def members(self, round: int | None = None) -> frozenset[str]:
        """Member ids (this node included) now, or in ``round``: those that left after it count."""
        if round is None:
            return self._members
        return self._members | {node for node, last in self._lingering if round <= last}

    def address_of(self, node_id: str) -> str | None:
        return self._addresses.get(node_id)

    def missing(self) -> list[str]:
        """Bootstrap addresses not yet answered by a peer that knows this node."""
        claimed = {self._addresses[i] for i in self._knows_me if i in self._addresses}
        return sorted(self._bootstrap - claimed - {self._transport.address})

    def leave(self, after_round: int = -1) -> None:
        """Tell every member this node takes part in no round after ``after_round`` (-1: none)."""
        self._transport.call_soon(lambda: self._send_leave(after_round))

    # -- network thread ----------------------------------------------------------------------

    def on_message(self, message: Message) -> None:
        if message.kind == "leave":
            last_round = message.meta.get("after_round", -1)
            self._departed[message.sender] = (message.session, last_round if type(last_round) is int else -1)
            self._addresses.pop(message.sender, None)
            self._knows_me.discard(message.sender)
        elif self._departed.get(message.sender, (None,))[0] != message.session:
            self._on_hello(message)
        self._update()

    def on_tick(self, now: float) -> float:
        if not self._dialed:
            for address in self._bootstrap - {self._transport.address}:
                self._transport.connect(address)
            self._dialed = True
            return now + CONNECT_GRACE_S
        self._update()
        self._say_hello()
        settled = self.ready.is_set() and self._knows_me >= self._addresses.keys()
        return now + (HEARTBEAT_INTERVAL_S if settled else HELLO_INTERVAL_S)

    def _on_hello(self, message: Message) -> None:
        try:
            address = parse_endpoint(str(message.meta.get("address", "")))
        except AddressError:
            self._transport.stats.rejected["bad_hello"] += 1
            return
        knows = message.meta.get("knows", [])
        first_contact = message.sender not in self._addresses
        self._departed.pop(message.sender, None)
        self._addresses[message.sender] = address
        if isinstance(knows, list) and self._transport.node_id in knows:
            self._knows_me.add(message.sender)
        elif first_contact:
            self._transport.connect(address)
            self._transport.tick_within(CONNECT_GRACE_S)  # answer soon: the sender waits for it

    def _update(self) -> None:
        members = frozenset({self._transport.node_id, *self._addresses})
        lingering = tuple((node, last) for node, (_, last) in self._departed.items() if last >= 0)
        if members != self._members or lingering != self._lingering:
            self._members, self._lingering = members, lingering
            self._transport.notify()
        if not self.ready.is_set() and not self.missing():
            self._say_hello()  # make sure every peer has heard that we know it
            self.ready.set()

    def _say_hello(self) -> None:
        for address in self._bootstrap | set(self._addresses.values()):
            if address != self._transport.address:
                self._hello(address)

    def _hello(self, address: str) -> None:
        meta = {"address": self._transport.address, "knows": sorted(self._addresses)}
        self._transport.send(address, "hello", 0, meta=meta)

    def _send_leave(self, after_round: int) -> None:
        for address in self._addresses.values():
            self._transport.send(address, "leave", 0, meta={"after_round": after_round})
