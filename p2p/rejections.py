"""Rejected input: counted per reason and per peer, logged without flooding, and a peer that keeps
sending garbage shunned for a while.

A peer is whoever the transport can name for a message: its CURVE public key on a secure node
(a peer cannot forge another's), its claimed routing id on an ``--insecure`` one (it can).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0
SHUN_AFTER = 100  # rejections within SHUN_WINDOW_S...
SHUN_WINDOW_S = 10.0
SHUN_FOR_S = 60.0  # ...shun the peer this long


class Rejections:
    """Counters and policy for rejected messages; used on the network thread only."""

    def __init__(
        self,
        *,
        log_interval_s: float = LOG_INTERVAL_S,
        shun_after: int = SHUN_AFTER,
        shun_window_s: float = SHUN_WINDOW_S,
        shun_for_s: float = SHUN_FOR_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.by_reason: Counter[str] = Counter()
        self.by_peer: dict[str, Counter[str]] = {}
        self.shunned_peers: set[str] = set()  # every peer ever shunned (for the report)
        self._log_interval_s = log_interval_s
        self._shun_after = shun_after
        self._shun_window_s = shun_window_s
        self._shun_for_s = shun_for_s
        self._clock = clock
        self._recent: dict[str, deque[float]] = {}
        self._shunned_until: dict[str, float] = {}
        self._logged_at: dict[str, float] = {}
        self._unlogged: dict[str, Counter[str]] = {}

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
            log.warning("no longer shunning %s", peer)
            return False
        return True

    def reject(self, peer: str, reason: str, detail: str = "") -> None:
        """Count one rejected message, log (at most once per peer per interval), maybe shun."""
        now = self._clock()
        self.by_reason[reason] += 1
        self.by_peer.setdefault(peer, Counter())[reason] += 1
        self._unlogged.setdefault(peer, Counter())[reason] += 1
        if now - self._logged_at.get(peer, -float("inf")) >= self._log_interval_s:
            self._logged_at[peer] = now
            counts = self._unlogged.pop(peer)
            log.warning(
                "rejected %d message(s) from %s (%s); latest: %s %s",
                sum(counts.values()),
                peer,
                ", ".join(f"{r}: {n}" for r, n in counts.most_common()),
                reason,
                detail,
            )
        if reason != "shunned":
            self._maybe_shun(peer, now)

    def _maybe_shun(self, peer: str, now: float) -> None:
        recent = self._recent.setdefault(peer, deque())
        recent.append(now)
        while recent and recent[0] < now - self._shun_window_s:
            recent.popleft()
        if len(recent) >= self._shun_after and peer not in self._shunned_until:
            self._shunned_until[peer] = now + self._shun_for_s
            self.shunned_peers.add(peer)
            recent.clear()
            log.warning(
                "shunning %s for %g s: %d rejected messages within %g s",
                peer,
                self._shun_for_s,
                self._shun_after,
                self._shun_window_s,
            )
