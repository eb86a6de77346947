"""Rate limits for what a peer can make a node do: token buckets, and log lines that cannot flood.

A hostile or broken peer decides how often a node would log a rejection, add a member or answer
a beacon; each of those goes through a bucket here, so it costs the node a bounded rate
whatever the peer sends.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TypeVar

MAX_KEYS = 1024  # buckets kept per limiter; the least recently used is forgotten beyond that
Key = TypeVar("Key", bound=Hashable)
Value = TypeVar("Value")


def lru_entry(table: OrderedDict[Key, Value], key: Key, make: Callable[[], Value], limit: int) -> Value:
    """``table[key]`` (made if missing) moved to the most recently used end; the least
    recently used entries dropped beyond ``limit``. How every per-peer table stays bounded."""
    if key not in table:
        table[key] = make()
        if len(table) > limit:
            table.popitem(last=False)
    table.move_to_end(key)
    return table[key]


class Bucket:
    """A token bucket: ``burst`` tokens, refilled at ``rate`` per second."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.at = now

    def refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def take(self, now: float, tokens: float = 1.0) -> bool:
        self.refill(now)
        if self.tokens < tokens:
            return False
        self.tokens -= tokens
        return True


class KeyedLimiter:
    """One bucket per key (a peer, an address), at most ``max_keys`` of them (least recently
    used forgotten first: a forgotten key starts again with a full bucket, which costs at most
    one burst per key that a peer can cycle through)."""

    def __init__(
        self,
        rate: float,
        burst: float,
        *,
        max_keys: int = MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rate = rate
        self._burst = burst
        self._max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, Bucket] = OrderedDict()

    def allow(self, key: str, tokens: float = 1.0) -> bool:
        now = self._clock()
        bucket = lru_entry(self._buckets, key, lambda: Bucket(self._rate, self._burst, now), self._max_keys)
        return bucket.take(now, tokens)


class QuietLog:
    """Log lines of one kind at most once per ``interval_s`` per key and ``per_s`` overall;
    the lines held back are counted into the next one that goes out."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = 10.0,
        per_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._per_key = KeyedLimiter(1.0 / interval_s, 1.0, clock=clock)
        self._overall = Bucket(per_s, 10.0 * per_s, clock())
        self._clock = clock
        self.suppressed = 0

    def warning(self, key: str, message: str, *args: object, exc_info: bool = False) -> bool:
        """Log unless over the limits; returns whether the line went out."""
        return self.log(logging.WARNING, key, message, *args, exc_info=exc_info)

    def log(self, level: int, key: str, message: str, *args: object, exc_info: bool = False) -> bool:
        if not (self._per_key.allow(key) and self._overall.take(self._clock())):
            self.suppressed += 1
            return False
        if self.suppressed:
            message += " (%d lines held back before this one)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        self._logger.log(level, message, *args, exc_info=exc_info)
        return True
