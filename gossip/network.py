"""The small interface gossip algorithms use to reach peers.

``p2p.Peer`` implements it over ZeroMQ; an in-memory simulator can implement it too, so an
algorithm is written once. Nothing here opens a socket.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from gossip.buffers.pieces import Piece


class Envelope(Protocol):
    """A received, already wire-validated message: whole, or one piece of it (for the kinds
    an algorithm takes piece by piece: :meth:`PeerNetwork.take_pieces`)."""

    @property
    def kind(self) -> str: ...
    @property
    def sender(self) -> str: ...
    @property
    def round(self) -> int: ...
    @property
    def tensors(self) -> Sequence[np.ndarray]: ...
    @property
    def meta(self) -> Mapping[str, Any]: ...
    @property
    def piece(self) -> Piece | None: ...


class Background(Protocol):
    """Work started by :meth:`PeerNetwork.start_background` (a ``threading.Thread`` is one)."""

    def join(self, timeout: float | None = None) -> None:
        """Wait until it ended (at most ``timeout`` s); ask it to end first, it polls a flag."""
        ...


class PeerNetwork(Protocol):
    """A node's view of the mesh."""

    @property
    def node_id(self) -> str: ...

    def now(self) -> float:
        """Seconds on the mesh's clock, which every wait and round time is measured on:
        ``time.monotonic()`` in a real mesh, virtual time in a simulator."""
        ...

    def members(self, round: int | None = None) -> frozenset[str]:
        """Member ids, this node included: now, or in gossip ``round`` (a node that left after
        round R is still a member of rounds up to R, so views agree on each round's graph)."""
        ...

    def not_listening(self) -> frozenset[str]:
        """The members that accept no connection (``p2p.Peer(listen=None)``): the topology never pairs
        two of them (see ``topologies.graphs.pair_with_listeners``)."""
        ...

    def send(
        self,
        to: str,
        kind: str,
        round: int,
        tensors: Sequence[np.ndarray] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        """Queue a message without blocking; tensors must stay unmodified afterwards."""
        ...

    def wire_bytes(self, nbytes: int) -> int:
        """The bytes on the wire of ``nbytes`` of tensors sent: the same in a real mesh; in a
        simulator, whose small vectors stand for a larger model, that model's share."""
        ...

    def backlog(self, to: str) -> int:
        """Messages with tensors this node sent to ``to`` that have not left it yet (queued here,
        or in the transport, behind a link that carries less than is sent): an algorithm whose
        math allows it holds a model back rather than queue it (0 where nothing queues)."""
        ...

    def missed(self, node_id: str) -> None:
        """A hint from the algorithm: ``node_id`` sent nothing when it was expected to."""
        ...

    def start_at_round(self, first_round: int) -> None:
        """Tell the mesh this (late-joining) node takes part in rounds >= ``first_round``."""
        ...

    def recv(self, timeout: float, kinds: Collection[str] | None = None) -> Envelope | None:
        """The oldest message (of one of ``kinds``, if given), or None after ``timeout`` s or
        when the membership changed."""
        ...

    def start_background(self, name: str, target: Callable[[], None]) -> Background:
        """Run ``target`` beside the caller (an asynchronous algorithm's exchanger): an OS thread
        in a real mesh, a coroutine on the virtual clock in a simulator, so an algorithm never
        starts threads itself."""
        ...

    def take_pieces(self, kinds: Collection[str]) -> None:
        """Hand on large messages of ``kinds`` piece by piece as they arrive (each an envelope
        with its ``piece``), so that the algorithm mixes them in as they come instead of holding
        whole messages; where messages travel whole (in memory), they still come whole."""
        ...


class PeerWrapper:
    """A ``PeerNetwork`` that passes every call on to ``peer``; subclasses change what they
    intercept (phase timing, a Byzantine test node)."""

    def __init__(self, peer: PeerNetwork) -> None:
        self._peer = peer

    @property
    def node_id(self) -> str:
        return self._peer.node_id

    def now(self) -> float:
        return self._peer.now()

    def members(self, round: int | None = None) -> frozenset[str]:
        return self._peer.members(round)

    def not_listening(self) -> frozenset[str]:
        return self._peer.not_listening()

    def send(
        self,
        to: str,
        kind: str,
        round: int,
        tensors: Sequence[np.ndarray] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self._peer.send(to, kind, round, tensors, meta)

    def recv(self, timeout: float, kinds: Collection[str] | None = None) -> Envelope | None:
        return self._peer.recv(timeout, kinds)

    def wire_bytes(self, nbytes: int) -> int:
        return self._peer.wire_bytes(nbytes)

    def backlog(self, to: str) -> int:
        return self._peer.backlog(to)

    def missed(self, node_id: str) -> None:
        self._peer.missed(node_id)

    def start_at_round(self, first_round: int) -> None:
        self._peer.start_at_round(first_round)

    def start_background(self, name: str, target: Callable[[], None]) -> Background:
        return self._peer.start_background(name, target)

    def take_pieces(self, kinds: Collection[str]) -> None:
        self._peer.take_pieces(kinds)
