"""The network of a machine's local rank 1, 2...: a data transport of its own, and the machine's
member view, handed over by local rank 0.

A machine of N local ranks is one member of the mesh: rank 0 runs the full :class:`~p2p.Peer`
(membership, failure detection, state serving) and its member record carries the data
addresses of the other ranks (``Member.ranks``). Rank r gossips its slice of the model with
rank r of the other machines, through a :class:`LocalRankPeer`: it sends to the rank-r address
in each member's record and takes messages only from members, with the key of their record.
It runs no failure detection of its own: the view it answers from is rank 0's, imported
(:func:`encode_view` / :meth:`LocalRankPeer.import_view`) at each round by the training loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from p2p.endpoint.shared import Endpoint
from p2p.membership.protocol import from_member, members_in_round
from p2p.membership.table import MAX_LOCAL_RANKS, Member
from p2p.security.curve import Curve
from p2p.transport.network_thread import Transport
from p2p.wire import Limits, Message

MAX_VIEW_BYTES = 64 << 20


def encode_view(view: Iterable[Member]) -> bytes:
    """A member view (the machine's own record first) as bytes for the other local ranks."""
    data: bytes = msgpack.packb([member.to_wire() for member in view])
    return data


def decode_view(data: bytes) -> tuple[Member, ...]:
    """The view :func:`encode_view` made; raises ValueError on anything else."""
    if len(data) > MAX_VIEW_BYTES:
        raise ValueError(f"a member view is at most {MAX_VIEW_BYTES} bytes, got {len(data)}")
    try:
        raw = msgpack.unpackb(data, max_array_len=1 << 20, max_map_len=0)
    except Exception as exc:
        raise ValueError(f"not a member view: {exc}") from None
    if not isinstance(raw, list) or not raw:
        raise ValueError("a member view is a non-empty list of member records")
    return tuple(Member.from_wire(record) for record in raw)


class LocalRankPeer(Endpoint):
    """A ``gossip.network.PeerNetwork`` for local rank ``rank`` (>= 1) of machine ``node_id``.

    Args are the :class:`~p2p.transport.network_thread.Transport`'s (``curve``: the machine's keys, which
    every rank of it uses).
    """

    def __init__(
        self,
        node_id: str,
        rank: int,
        listen: str,
        *,
        advertise: str | None = None,
        limits: Limits = Limits(),
        linger_s: float = 1.0,
        curve: Curve | None = None,
        max_send_bytes_per_s: float | None = None,
        streams: int = 1,
    ) -> None:
        if not 1 <= rank < MAX_LOCAL_RANKS:
            raise ValueError(f"a LocalRankPeer is local rank 1..{MAX_LOCAL_RANKS - 1}, got {rank}")
        self.rank = rank
        super().__init__(
            Transport(
                node_id,
                listen,
                advertise=advertise,
                limits=limits,
                linger_s=linger_s,
                curve=curve,
                max_send_bytes_per_s=max_send_bytes_per_s,
                streams=streams,
            )
        )
        self.transport.screen = self._screen
        self._view: dict[str, Member] = {}  # replaced whole, so readers on any thread see one view

    def start(self) -> str:
        """Bind and start networking (once: later calls only return the address); returns
        the address to give rank 0 for its record."""
        return self.transport.address or self.transport.start()

    def import_view(self, data: bytes) -> None:
        """Take rank 0's member view (:func:`encode_view`); raises ValueError if malformed."""
        members = decode_view(data)
        if members[0].id != self.node_id:
            raise ValueError(f"the view is {members[0].id}'s, not this machine's ({self.node_id})")
        self._view = {m.id: m for m in members}
        self.transport.notify()  # a receiver waiting out a round sees the change

    def members(self, round: int | None = None) -> frozenset[str]:
        return members_in_round(self._view.values(), round)

    def not_listening(self) -> frozenset[str]:
        return frozenset(m.id for m in self._view.values() if not m.reachable)

    def send(
        self,
        to: str,
        kind: str,
        round: int,
        tensors: Sequence[np.ndarray] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.transport.check_running()
        route = self._route(to)
        if isinstance(route, str):
            self.stats.drop(route)
            return
        address, key = route
        self.transport.send(address, kind, round, tensors, meta, key=key, member=True)

    def backlog(self, to: str) -> int:
        route = self._route(to)
        return 0 if isinstance(route, str) else self.transport.backlog(route[0])

    def _route(self, to: str) -> tuple[str, str | None] | str:
        """The address and key of the rank of ``to``'s machine that is this one's peer, or why
        there is none (a drop reason)."""
        member = self._view.get(to)
        if member is None or not member.status.live:
            return "unknown_peer"
        if len(member.ranks) < self.rank:
            return "no_local_rank"  # a machine of fewer ranks (a config mismatch)
        return member.ranks[self.rank - 1], member.key or None

    def missed(self, node_id: str) -> None:
        """Failure detection is rank 0's: nothing to do here."""

    def start_at_round(self, first_round: int) -> None:
        """Rank 0 announces the machine's first round: nothing to do here."""

    def leave(self, after_round: int = -1) -> None:
        """Rank 0 leaves for the machine: nothing to do here."""

    def close(self) -> None:
        self.transport.close()

    def _screen(self, message: Message) -> bool:
        return from_member(self.transport, self._view.get(message.sender), message)
