"""Joining with state: a newcomer pulls a live member's training state before it trains.

Without it a new node would average random weights into the mesh. The state (flat parameters,
optimizer buffers, step and round counters) travels as ``state_chunk`` messages of at most
``chunk_bytes`` each, so a large model never needs one huge message; the first chunk carries the
versioned layout, and the receiver checks every chunk and the whole against it (sizes, dtypes,
shapes, finiteness, counters in range) before any of it touches the model.

A request costs its source a copy of the whole state: a source answers only members, each at
most once per ``RETRY_S / 2`` (a joiner asks again every ``RETRY_S`` while it waits), and at
most ``MAX_TRANSFERS`` transfers per ``RETRY_S`` in all, so no peer can make it copy and queue
more than that however many requests it sends.
"""

from __future__ import annotations

import math
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gossip.network import PeerNetwork
from gossip.vector import all_finite

STATE_VERSION = 1
REQUEST = "state_request"
CHUNK = "state_chunk"
KINDS = (CHUNK,)
CHUNK_BYTES = 1 << 20
RETRY_S = 3.0  # a transfer with no chunk for this long is asked for again (a lost request or answer)
MAX_TRANSFERS = 2  # state transfers a source starts per RETRY_S, to all requesters together
MAX_COUNTER = 2**53  # counters (steps, rounds, rates) are non-negative and exact as floats
POLL_S = 0.25  # how often a fetch looks whether it was cancelled
REASK_S = 0.5  # a first request that brought nothing this soon is sent once more
_DTYPES = ("float16", "float32", "float64", "int64")


class StateTransferError(RuntimeError):
    """No valid state arrived; the message says from whom and why."""


@dataclass(frozen=True)
class Snapshot:
    """Named flat arrays plus counters (``step``, ``round``, ``rounds_per_s``...)."""

    tensors: Mapping[str, np.ndarray]
    counters: Mapping[str, float]


class StateServer:
    """Answers newcomers' state requests between training steps (never blocks), within the
    limits in the module docstring; ``refused`` counts the requests it let go, by reason."""

    def __init__(
        self, peer: PeerNetwork, take_snapshot: Callable[[], Snapshot], chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self._peer = peer
        self._take_snapshot = take_snapshot
        self._chunk_bytes = chunk_bytes
        self._answered: dict[str, float] = {}  # requester -> when (peer.now() s)
        self._recent: deque[float] = deque()  # when the last transfers started
        self.refused: Counter[str] = Counter()

    def serve(self) -> int:
        """Answer the requests waiting in the inbox; returns how many were answered."""
        served, snapshot = 0, None
        while (request := self._peer.recv(0, (REQUEST,))) is not None:
            transfer, now = request.meta.get("transfer"), self._peer.now()
            reason = self._refusal(request.sender, transfer, now)
            if reason is not None:
                self.refused[reason] += 1
                continue
            assert type(transfer) is int  # (checked by _refusal)
            snapshot = snapshot or self._take_snapshot()  # one copy for the requests answered together
            send_snapshot(self._peer, request.sender, transfer, snapshot, self._chunk_bytes)
            self._answered[request.sender] = now
            self._recent.append(now)
            served += 1
        return served

    def _refusal(self, requester: str, transfer: Any, now: float) -> str | None:
        while self._recent and self._recent[0] <= now - RETRY_S:
            self._recent.popleft()
        members = self._peer.members()
        for gone in self._answered.keys() - members:
            del self._answered[gone]
        if type(transfer) is not int:
            return "malformed"
        if requester not in members:
            return "not_a_member"
        if now - self._answered.get(requester, -math.inf) < RETRY_S / 2:
            return "too_soon"
        if len(self._recent) >= MAX_TRANSFERS:
            return "busy"
        return None


def send_snapshot(peer: PeerNetwork, to: str, transfer: int, snapshot: Snapshot, chunk_bytes: int) -> None:
    arrays = [np.ascontiguousarray(a) for a in snapshot.tensors.values()]
    payload = (
        np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays]) if arrays else np.empty(0, np.uint8)
    )
    layout = [[name, a.dtype.name, list(a.shape)] for name, a in zip(snapshot.tensors, arrays, strict=True)]
    count = max(1, math.ceil(payload.size / chunk_bytes))
    for index in range(count):
        meta: dict[str, Any] = {
            "transfer": transfer,
            "index": index,
            "count": count,
            "version": STATE_VERSION,
        }
        if index == 0:
            meta.update(layout=layout, counters=dict(snapshot.counters), total=int(payload.size))
        piece = payload[index * chunk_bytes : (index + 1) * chunk_bytes]
        peer.send(to, CHUNK, 0, [piece], meta)


def fetch_snapshot(
    peer: PeerNetwork,
    source: str,
    *,
    timeout: float,
    max_bytes: int,
    chunk_bytes: int = CHUNK_BYTES,
    retry_s: float = RETRY_S,
    patience_s: float = math.inf,
    cancelled: Callable[[], bool] = lambda: False,
) -> Snapshot:
    """Ask ``source`` for its state and reassemble it; raises StateTransferError (also when
    ``cancelled()`` turns true: it is asked every ``POLL_S``).

    A request that brings nothing within ``REASK_S`` is sent once more (the first is often
    lost: sent before this node's connection to the source was up, or before the source knew
    of this node; a source answers one request per requester per ``RETRY_S / 2``, so never
    both). A transfer that stalls for ``retry_s`` (a request or chunk lost, e.g. to a
    connection the source still had to this node's previous incarnation) is asked for again
    under a new id, and chunks of the earlier one are ignored from then on. A source that sends
    nothing for ``patience_s`` is given up (the caller may try another)."""
    started = time.monotonic()
    deadline = started + min(timeout, patience_s)
    assembly: _Assembly | None = None
    transfer, stalls_at, reask_at = 0, -math.inf, math.inf
    while assembly is None or not assembly.complete:
        now = time.monotonic()
        if cancelled():
            raise StateTransferError(f"state from {source}: cancelled")
        if now >= deadline:
            got = "nothing" if assembly is None else f"{assembly.received} of {assembly.count} chunks"
            why = f"within {timeout:g} s" if now >= started + timeout else f"(silent for {patience_s:g} s)"
            raise StateTransferError(f"state from {source}: {got} {why}")
        if now >= stalls_at:
            transfer, assembly = secrets.randbits(62), None
            peer.send(source, REQUEST, 0, meta={"transfer": transfer})
            stalls_at, reask_at = now + retry_s, now + REASK_S
        elif now >= reask_at and assembly is None:
            peer.send(source, REQUEST, 0, meta={"transfer": transfer})
            reask_at = math.inf
        message = peer.recv(min(deadline, stalls_at, reask_at, now + POLL_S) - now, KINDS)
        if message is None or message.sender != source or message.meta.get("transfer") != transfer:
            continue
        stalls_at = time.monotonic() + retry_s
        deadline = min(started + timeout, stalls_at - retry_s + patience_s)
        meta = message.meta
        if assembly is None:
            assembly = _Assembly.start(meta, max_bytes, chunk_bytes, source)
        assembly.add(meta, message.tensors, source)
    return assembly.snapshot(source)


@dataclass
class _Assembly:
    """A transfer being received: the layout from chunk 0, a buffer the chunks fill."""

    count: int
    layout: list[tuple[str, np.dtype, tuple[int, ...]]]
    counters: dict[str, float]
    buffer: np.ndarray
    chunk_bytes: int
    seen: set[int]

    @property
    def received(self) -> int:
        return len(self.seen)

    @property
    def complete(self) -> bool:
        return len(self.seen) == self.count

    @classmethod
    def start(cls, meta: Mapping[str, Any], max_bytes: int, chunk_bytes: int, source: str) -> _Assembly:
        def bad(why: str) -> StateTransferError:
            return StateTransferError(f"state from {source} rejected: {why}")

        if meta.get("version") != STATE_VERSION:
            raise bad(f"version {meta.get('version')!r}, this node reads {STATE_VERSION}")
        if meta.get("index") != 0:
            raise bad("the first chunk to arrive must be chunk 0 (chunks are sent in order)")
        total, count, raw_layout, counters = (meta.get(k) for k in ("total", "count", "layout", "counters"))
        if type(total) is not int or not 0 <= total <= max_bytes:
            raise bad(f"total size {total!r} is not in 0..{max_bytes}")
        if type(count) is not int or count != max(1, math.ceil(total / chunk_bytes)):
            raise bad(f"{count!r} chunks do not fit {total} bytes in chunks of {chunk_bytes}")
        if not isinstance(counters, dict) or not all(
            isinstance(k, str) and type(v) in (int, float) and 0 <= v <= MAX_COUNTER
            for k, v in counters.items()
        ):
            raise bad(f"counters must map names to numbers in 0..{MAX_COUNTER}")
        layout = []
        if not isinstance(raw_layout, list):
            raise bad("no layout")
        for entry in raw_layout:
            if (
                not isinstance(entry, list)
                or len(entry) != 3
                or not isinstance(entry[0], str)
                or entry[1] not in _DTYPES
                or not isinstance(entry[2], list)
                or not all(type(d) is int and d >= 0 for d in entry[2])
            ):
                raise bad(f"bad layout entry {entry!r}")
            layout.append((entry[0], np.dtype(entry[1]), tuple(entry[2])))
        if sum(dtype.itemsize * math.prod(shape) for _, dtype, shape in layout) != total:
            raise bad("the layout does not add up to the total size")
        return cls(count, layout, dict(counters), np.empty(total, np.uint8), chunk_bytes, set())

    def add(self, meta: Mapping[str, Any], tensors: Any, source: str) -> None:
        index = meta.get("index")
        if type(index) is not int or not 0 <= index < self.count or index in self.seen or len(tensors) != 1:
            raise StateTransferError(f"state from {source} rejected: bad or repeated chunk {index!r}")
        start = index * self.chunk_bytes
        expected = min(self.chunk_bytes, self.buffer.size - start)
        piece = tensors[0]
        if piece.dtype != np.uint8 or piece.size != expected:
            raise StateTransferError(f"state from {source} rejected: chunk {index} has the wrong size")
        self.buffer[start : start + expected] = piece
        self.seen.add(index)

    def snapshot(self, source: str) -> Snapshot:
        tensors: dict[str, np.ndarray] = {}
        offset = 0
        for name, dtype, shape in self.layout:
            size = dtype.itemsize * math.prod(shape)
            array = self.buffer[offset : offset + size].view(dtype).reshape(shape)
            if array.dtype.kind == "f" and not all_finite(array):
                raise StateTransferError(f"state from {source} rejected: {name} has NaN or infinite values")
            tensors[name] = array
            offset += size
        return Snapshot(tensors, self.counters)
