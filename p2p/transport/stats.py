"""Counters of what a node's transport sent, received, dropped and rejected."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from p2p.security.rejections import Rejections


@dataclass
class TransportStats:
    """Counters kept by the network thread; read them from any thread (the properties are
    copies, so a reader never iterates a counter the network thread is changing)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    rejections: Rejections = field(default_factory=Rejections)
    _dropped: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def drop(self, reason: str) -> None:
        """Count a well-formed message not sent or not delivered (any thread)."""
        with self._lock:
            self._dropped[reason] += 1

    @property
    def dropped(self) -> Counter[str]:
        with self._lock:
            return Counter(self._dropped)

    @property
    def rejected(self) -> Counter[str]:
        """Rejected messages by reason."""
        return Counter(dict(self.rejections.by_reason))

    @property
    def rejected_by_peer(self) -> dict[str, Counter[str]]:
        return {peer: Counter(dict(reasons)) for peer, reasons in dict(self.rejections.by_peer).items()}

    @property
    def messages_rejected(self) -> int:
        return sum(self.rejected.values())
