"""Joining with state: a newcomer pulls a live member's training state before it trains.

Without it a new node would average random weights into the mesh. The state (flat parameters,
optimizer buffers, step and round counters) travels as ``state_chunk`` messages of at most
``chunk_bytes`` each, so a large model never needs one huge message; the first chunk carries the
versioned layout, and the receiver checks every chunk and the whole against it (sizes, dtypes,
shapes, finiteness) before any of it touches the model.
"""

from __future__ import annotations

import math
import secrets
import time
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
_DTYPES = ("float16", "float32", "float64", "int64")


class StateTransferError(RuntimeError):
    """No valid state arrived; the message says from whom and why."""


@dataclass(frozen=True)
class Snapshot:
    """Named flat arrays plus counters (``step``, ``round``, ``rounds_per_s``...)."""

    tensors: Mapping[str, np.ndarray]
    counters: Mapping[str, float]


def serve_requests(
    peer: PeerNetwork, take_snapshot: Callable[[], Snapshot], chunk_bytes: int = CHUNK_BYTES
) -> int:
    """Answer the state requests waiting in the inbox (never blocks); returns how many."""
    served = 0
    while (request := peer.recv(0, (REQUEST,))) is not None:
        transfer = request.meta.get("transfer")
        if type(transfer) is not int:
            continue
        send_snapshot(peer, request.sender, transfer, take_snapshot(), chunk_bytes)
        served += 1
    return served


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
) -> Snapshot:
    """Ask ``source`` for its state and reassemble it; raises StateTransferError.

    A transfer that stalls for ``retry_s`` (a request or chunk lost, e.g. to a connection the
    source still had to this node's previous incarnation) is asked for again under a new id,
    and chunks of the earlier one are ignored from then on."""
    deadline = time.monotonic() + timeout
    assembly: _Assembly | None = None
    transfer, stalls_at = 0, -math.inf
    while assembly is None or not assembly.complete:
        now = time.monotonic()
        if now >= deadline:
            got = "nothing" if assembly is None else f"{assembly.received} of {assembly.count} chunks"
            raise StateTransferError(f"state from {source}: {got} within {timeout:g} s")
        if now >= stalls_at:
            transfer, assembly = secrets.randbits(62), None
            peer.send(source, REQUEST, 0, meta={"transfer": transfer})
            stalls_at = now + retry_s
        message = peer.recv(min(deadline, stalls_at) - now, KINDS)
        if message is None or message.sender != source or message.meta.get("transfer") != transfer:
            continue
        stalls_at = time.monotonic() + retry_s
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
            isinstance(k, str) and type(v) in (int, float) and math.isfinite(v) for k, v in counters.items()
        ):
            raise bad("counters must map names to finite numbers")
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
