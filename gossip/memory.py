"""An in-process network: peers exchange messages through memory, no sockets.

It implements :class:`gossip.network.PeerNetwork`, so the algorithms that run over ZeroMQ run
here unchanged: for tests of the averaging math at sizes a machine cannot run as processes, and
as the transport of a simulator. Messages carry references to the sender's tensors (which the
interface says stay unmodified), handed to receivers read-only.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class MemoryMessage:
    kind: str
    sender: str
    round: int
    tensors: Sequence[np.ndarray]
    meta: Mapping[str, Any] = field(default_factory=dict)


class MemoryNetwork:
    """The shared medium: which peers are members, and their inboxes."""

    def __init__(self) -> None:
        self._peers: dict[str, MemoryPeer] = {}
        self._members: frozenset[str] = frozenset()
        self._last_rounds: dict[str, int] = {}  # departed id -> last round it took part in
        self._lock = threading.Lock()

    def join(self, node_id: str) -> MemoryPeer:
        peer = MemoryPeer(self, node_id)
        with self._lock:
            self._peers[node_id] = peer
            self._members = frozenset(self._peers)
        self._wake_all()
        return peer

    def leave(self, node_id: str, after_round: int = -1) -> None:
        with self._lock:
            self._peers.pop(node_id, None)
            self._members = frozenset(self._peers)
            self._last_rounds[node_id] = after_round
        self._wake_all()

    def members(self, round: int | None = None) -> frozenset[str]:
        if round is None:
            return self._members
        return self._members | {node for node, last in list(self._last_rounds.items()) if round <= last}

    def deliver(self, to: str, message: MemoryMessage) -> bool:
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
        self._inbox: deque[MemoryMessage] = deque()
        self._ready = threading.Condition()
        self.bytes_sent = 0
        self.messages_dropped = 0

    @property
    def node_id(self) -> str:
        return self._node_id

    def members(self, round: int | None = None) -> frozenset[str]:
        return self.network.members(round)

    def send(
        self,
        to: str,
        kind: str,
        round: int,
        tensors: Sequence[np.ndarray] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        message = MemoryMessage(kind, self._node_id, round, tuple(_read_only(t) for t in tensors), meta or {})
        if self.network.deliver(to, message):
            self.bytes_sent += sum(t.nbytes for t in tensors)
        else:
            self.messages_dropped += 1

    def recv(self, timeout: float) -> MemoryMessage | None:
        with self._ready:
            if not self._inbox:
                self._ready.wait(timeout)
            return self._inbox.popleft() if self._inbox else None

    def put(self, message: MemoryMessage) -> None:
        with self._ready:
            self._inbox.append(message)
            self._ready.notify()

    def wake(self) -> None:
        with self._ready:
            self._ready.notify_all()


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view
