"""Rejected input: counted per reason and per peer, logged without flooding, and a peer that keeps
sending garbage shunned for a while.

A peer is whoever the transport can name for a message: its CURVE public key on a secure node
(a peer cannot forge another's), its claimed routing id on an ``--insecure`` one (it can).
At most ``max_peers`` peers are counted by name (the rest under ``OTHER_PEERS``) and tracked for
shunning (the least recently rejected forgotten first), so a sender changing names cannot grow
the tables; log lines are limited per peer and overall.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable

from p2p.security.ratelimit import QuietLog, lru_entry

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0
SHUN_AFTER = 100  # rejections within SHUN_WINDOW_S...
SHUN_WINDOW_S = 10.0
SHUN_FOR_S = 60.0  # ...shun the peer this long
MAX_PEERS = 1024
OTHER_PEERS = "(other peers)"


class Rejections:
    """Counters and policy for rejected messages; used on the network thread only."""

    def __init__(
        self,
        *,
        log_interval_s: float = LOG_INTERVAL_S,
        shun_after: int = SHUN_AFTER,
        shun_window_s: float = SHUN_WINDOW_S,
        shun_for_s: float = SHUN_FOR_S,
        max_peers: int = MAX_PEERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.by_reason: Counter[str] = Counter()
        self.by_peer: dict[str, Counter[str]] = {}
        self.shunned_peers: set[str] = set()  # peers shunned (for the report; at most max_peers)
        self._shun_after = shun_after
        self._shun_window_s = shun_window_s
        self._shun_for_s = shun_for_s
        self._max_peers = max_peers
        self._clock = clock
        self._log = QuietLog(log, interval_s=log_interval_s, clock=clock)
        self._recent: OrderedDict[str, deque[float]] = OrderedDict()
        self._shunned_until: dict[str, float] = {}
        self._unlogged: OrderedDict[str, Counter[str]] = OrderedDict()

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def shunned(self, peer: str) -> bool:
        """Whether ``peer``'s messages are dropped unread right now."""
        until = self._shunned_until.get(peer)
        if until is None:
            return False
        if self._clock() >= until:
            del self._shunned_until[peer]
            self._log.warning(f"unshun {peer}", "no longer shunning %s", peer)
            return False
        return True

    def reject(self, peer: str, reason: str, detail: str = "") -> None:
        """Count one rejected message, log (at most once per peer per interval), maybe shun."""
        now = self._clock()
        self.by_reason[reason] += 1
        counted = peer if peer in self.by_peer or len(self.by_peer) < self._max_peers else OTHER_PEERS
        self.by_peer.setdefault(counted, Counter())[reason] += 1
        counts = lru_entry(self._unlogged, peer, Counter, self._max_peers)
        counts[reason] += 1
        if self._log.warning(
            f"reject {peer}",
            "rejected %d message(s) from %s (%s); latest: %s %s",
            sum(counts.values()),
            peer,
            ", ".join(f"{r}: {n}" for r, n in counts.most_common()),
            reason,
            detail,
        ):
            del self._unlogged[peer]
        if reason != "shunned":
            self._maybe_shun(peer, now)

    def _maybe_shun(self, peer: str, now: float) -> None:
        recent = lru_entry(self._recent, peer, deque, self._max_peers)
        recent.append(now)
        while recent and recent[0] < now - self._shun_window_s:
            recent.popleft()
        if len(recent) >= self._shun_after and peer not in self._shunned_until:
            for expired in [p for p, until in self._shunned_until.items() if until <= now]:
                del self._shunned_until[expired]
            self._shunned_until[peer] = now + self._shun_for_s
            if len(self.shunned_peers) < self._max_peers:
                self.shunned_peers.add(peer)
            recent.clear()
            self._log.warning(
                f"shun {peer}",
                "shunning %s for %g s: %d rejected messages within %g s",
                peer,
                self._shun_for_s,
                self._shun_after,
                self._shun_window_s,
            )
