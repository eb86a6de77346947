"""An in-process network: peers exchange messages through memory, no sockets.

It offers the gossip algorithms what :class:`p2p.Peer` offers them (``gossip.network.PeerNetwork``),
so the algorithms that run over ZeroMQ run here unchanged: for tests of the averaging math at
sizes a machine cannot run as processes, and as the transport of a simulator. Messages carry
references to the sender's tensors (which the interface says stay unmodified), handed to
receivers read-only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from p2p.endpoint.threads import start_thread
from p2p.transport.inbox import Inbox
from p2p.wire import Message

MAX_ROUNDS_BUILT = 16  # rounds whose members a Roster keeps built


class Roster:
    """Exact membership by gossip round: who is a member now, and in each round (a node that
    left after round R stays a member of rounds up to R; a late joiner counts from its first
    round on), as ``PeerNetwork.members`` defines it.

    A round's members are built once per change: while nodes leave at their last round, the
    others ask for that round's members many times between two leaves (thousands of nodes
    finishing together). Readers may run beside a change (the in-memory network's threads): a
    change bumps the version after it is made, and a set built meanwhile keeps the version it
    began from, so it is not used after."""

    def __init__(self) -> None:
        self._current: frozenset[str] = frozenset()
        self._last_rounds: dict[str, int] = {}  # departed id -> last round it took part in
        self._first_rounds: dict[str, int] = {}  # member -> first round it takes part in
        self._latest_first = 0  # no member starts after this round: later rounds need no filtering
        self._latest_last = -1  # no departed node takes part after this round: nor do they
        self._version = 0  # bumped by every change
        self._built: dict[int, tuple[int, frozenset[str]]] = {}  # round -> (version, its members)

    # Each change sets the rounds first and the current members after them, so that a reader
    # who sees the new members also sees the rounds that qualify them, and bumps the version last.

    def join(self, node_id: str, first_round: int = 0) -> None:
        self._set_first_round(node_id, first_round)
        self._current = self._current | {node_id}
        self._version += 1

    def leave(self, node_id: str, after_round: int = -1) -> None:
        self._last_rounds[node_id] = after_round
        self._latest_last = max(self._latest_last, after_round)
        self._current = self._current - {node_id}
        self._version += 1

    def start_at_round(self, node_id: str, first_round: int) -> None:
        self._set_first_round(node_id, first_round)
        self._version += 1

    def _set_first_round(self, node_id: str, first_round: int) -> None:
        self._first_rounds[node_id] = first_round
        self._latest_first = max(self._latest_first, first_round)

    def members(self, round: int | None = None) -> frozenset[str]:
        if round is None or (round > self._latest_last and round >= self._latest_first):
            return self._current  # the common case: no set is built
        version = self._version
        built = self._built.get(round)
        if built is not None and built[0] == version:
            return built[1]
        lingering = {node for node, last in list(self._last_rounds.items()) if round <= last}
        members = self._current | lingering
        if round < self._latest_first:
            members = frozenset(m for m in members if self._first_rounds.get(m, 0) <= round)
        if len(self._built) >= MAX_ROUNDS_BUILT:
            self._built.clear()
        self._built[round] = (version, members)
        return members


class MemoryNetwork:
    """The shared medium: which peers are members, and their inboxes."""

    def __init__(self) -> None:
        self._peers: dict[str, MemoryPeer] = {}
        self._roster = Roster()
        self._lock = threading.Lock()

    def join(self, node_id: str, first_round: int = 0) -> MemoryPeer:
        peer = MemoryPeer(self, node_id)
        with self._lock:
            self._peers[node_id] = peer
            self._roster.join(node_id, first_round)
        self._wake_all()
        return peer

    def leave(self, node_id: str, after_round: int = -1) -> None:
        with self._lock:
            self._peers.pop(node_id, None)
            self._roster.leave(node_id, after_round)
        self._wake_all()

    def start_at_round(self, node_id: str, first_round: int) -> None:
        self._roster.start_at_round(node_id, first_round)
        self._wake_all()

    def members(self, round: int | None = None) -> frozenset[str]:
        return self._roster.members(round)

    def deliver(self, to: str, message: Message) -> bool:
        peer = self._peers.get(to)
        if peer is None:
            return False
        peer.put(message)
        return True

    def _wake_all(self) -> None:
        for peer in list(self._peers.values()):
            peer.wake()


class MemoryPeer:
    """One node's endpoint on a :class:`MemoryNetwork`."""

    def __init__(self, network: MemoryNetwork, node_id: str) -> None:
        self.network = network
        self._node_id = node_id
        self._inbox = Inbox(maxlen=1 << 20)
        self.bytes_sent = 0
        self.messages_dropped = 0

    @property
    def node_id(self) -> str:
        return self._node_id

    def now(self) -> float:
        return time.monotonic()

    def members(self, round: int | None = None) -> frozenset[str]:
        return self.network.members(round)

    def not_listening(self) -> frozenset[str]:
        return frozenset()  # every node of an in-memory mesh reaches every other

    def start_at_round(self, first_round: int) -> None:
        self.network.start_at_round(self._node_id, first_round)

    def missed(self, node_id: str) -> None:
        """Membership here is exact: there is nothing to probe."""

    def send(
        self,
        to: str,
        kind: str,
        round: int,
        tensors: Sequence[np.ndarray] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        message = Message(kind, self._node_id, round, tuple(read_only(t) for t in tensors), meta or {})
        if self.network.deliver(to, message):
            self.bytes_sent += sum(t.nbytes for t in tensors)
        else:
            self.messages_dropped += 1

    def wire_bytes(self, nbytes: int) -> int:
        return nbytes

    def backlog(self, to: str) -> int:
        return 0  # delivered as it is sent

    def recv(self, timeout: float, kinds: Collection[str] | None = None) -> Message | None:
        return self._inbox.get(timeout, kinds)

    def start_background(self, name: str, target: Callable[[], None]) -> threading.Thread:
        return start_thread(name, target)

    def take_pieces(self, kinds: Collection[str]) -> None:
        """Messages travel whole in memory: nothing to change."""

    def put(self, message: Message) -> None:
        self._inbox.put(message)

    def wake(self) -> None:
        self._inbox.notify()


def read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view: what a receiver gets of a sender's tensor."""
    view = array.view()
    view.flags.writeable = False
    return view
