"""Who sent a frame, as far as the transport can tell, and what it may claim.

A peer is its CURVE public key on a secure node (a peer cannot forge another's key), its claimed
routing id on an ``--insecure`` one (it can). On a secure node a key speaks for one node id: the
routing id of the first frame it sent; a frame of that key claiming another id is rejected
(``identity``), until the key has been silent for ``idle_s`` (then it may come back as another
id). Sequence state (the newest session and seq, for replay checks) is kept per peer, so no peer
can make another's messages look replayed.

At most ``max_peers`` are remembered, the least recently heard forgotten first, so a sender
that keeps changing its claimed id cannot grow the table.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_PEERS = 4096
IDLE_S = 60.0


@dataclass
class _Peer:
    node_id: str
    session: int = -1
    seq: int = -1
    heard: float = 0.0


class Identities:
    """Per-peer identity and sequence state; network thread only."""

    def __init__(self, *, max_peers: int = MAX_PEERS, idle_s: float = IDLE_S) -> None:
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._max_peers = max_peers
        self._idle_s = idle_s

    def __len__(self) -> int:
        return len(self._peers)

    def name(self, key: str, claimed: str, now: float) -> tuple[str, bool]:
        """The name rejections count a frame under, and whether the claimed id is the one this
        peer speaks for. Binds a new (or idle) key to ``claimed``."""
        if not key:
            return claimed, True
        peer = self._peers.get(key)
        if peer is None or now - peer.heard > self._idle_s:
            peer = self._remember(key, _Peer(claimed))
        peer.heard = now
        self._peers.move_to_end(key)
        return f"{peer.node_id} ({key})", peer.node_id == claimed

    def replayed(self, peer_id: str, session: int, seq: int, now: float) -> int | None:
        """The newest seq already taken from this peer's session if ``seq`` is not newer (a
        replay or a reordering), else None, recording ``(session, seq)`` as the newest."""
        peer = self._peers.get(peer_id)
        if peer is None:
            peer = self._remember(peer_id, _Peer(peer_id))
        self._peers.move_to_end(peer_id)
        peer.heard = now
        if peer.session == session and seq <= peer.seq:
            return peer.seq
        peer.session, peer.seq = session, seq
        return None

    def _remember(self, peer_id: str, peer: _Peer) -> _Peer:
        self._peers[peer_id] = peer
        if len(self._peers) > self._max_peers:
            self._peers.popitem(last=False)
        return peer
