"""A cap on what a node sends (``--max-send-mbps``), so a daemon can share an uplink.

A token bucket of bytes that may go into debt: a message (or a stream's next chunk) leaves when
the bucket is not in debt, and takes its size from it; the bucket refills at the cap's rate and
holds at most ``BURST_S`` of it. Over any stretch of a few messages a node sends at the cap; no
message waits longer than the debt the messages before it left. What waits keeps its order:
messages wait in one queue, a stream's chunks in the stream's (``p2p.transport.outbound``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from p2p.security.ratelimit import Bucket

BURST_S = 0.05  # the bucket holds this much of the rate: a burst at the link's speed


class SendPacer:
    """``bytes_per_s``: the cap."""

    def __init__(self, bytes_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"a send cap must be > 0 bytes/s, got {bytes_per_s}")
        self._bucket = Bucket(bytes_per_s, bytes_per_s * BURST_S, clock())
        self._clock = clock

    def wait_s(self) -> float:
        """Seconds until the next send may leave (0: now)."""
        self._bucket.refill(self._clock())
        return max(0.0, -self._bucket.tokens / self._bucket.rate)

    def spend(self, nbytes: int) -> None:
        """A send of ``nbytes`` left (the bucket may go into debt)."""
        self._bucket.refill(self._clock())
        self._bucket.tokens -= nbytes
