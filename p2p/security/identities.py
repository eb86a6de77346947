"""Who sent a frame, as far as the transport can tell, and its sequence state.

A peer is its CURVE public key on a secure node (a peer cannot forge another's key), its claimed
routing id on an ``--insecure`` one (it can). Rejections and shunning count per peer: a sender
that changes the id it claims on every message is still one peer. Sequence state (the newest
session and seq, for replay checks) is kept per key *and* claimed id (one key may serve a whole
mesh), so no key can make another's messages look replayed, whatever id it claims. Which ids a
key may speak for is membership's business (``Membership.screen``): a member's messages must
come with the key of its member record.

At most ``max_peers`` entries of each kind are remembered, the least recently heard forgotten
first, so a sender that keeps changing its claimed id cannot grow the tables.
"""

from __future__ import annotations

from collections import OrderedDict

from p2p.security.ratelimit import lru_entry

MAX_PEERS = 4096


class Identities:
    """Peer names and sequence state; network thread only."""

    def __init__(self, *, max_peers: int = MAX_PEERS) -> None:
        self._labels: OrderedDict[str, str] = OrderedDict()  # key -> the first id it was heard as
        self._sequences: OrderedDict[tuple[str, str, int], tuple[int, int]] = OrderedDict()
        self._max_peers = max_peers

    def __len__(self) -> int:
        return len(self._sequences)

    def name(self, key: str, claimed: str) -> str:
        """The name rejections count a frame under: ``ID (KEY)`` with the first id the key was
        heard as (so the same for every id it claims), or the claimed id without CURVE."""
        if not key:
            return claimed
        label = lru_entry(self._labels, key, lambda: claimed, self._max_peers)
        return f"{label} ({key})"

    def replayed(self, key: str, claimed: str, session: int, seq: int, lane: int = 0) -> int | None:
        """The newest seq taken from this sender's session on this ``lane`` (one of its
        connections, see ``p2p.transport.connections``: each is in order, not all together) if ``seq`` is
        not newer (a replay or a reordering), else None, recording ``(session, seq)`` as the newest."""
        last = lru_entry(self._sequences, (key, claimed, lane), lambda: (-1, -1), self._max_peers)
        if last[0] == session and seq <= last[1]:
            return last[1]
        self._sequences[(key, claimed, lane)] = (session, seq)
        return None
