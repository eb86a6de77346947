"""Joining with state: what a newcomer takes from live members before it trains, and the
protocol it travels in.

Without it a new node would average random weights into the mesh. A node's state is a list of
named flat arrays (parameters, optimizer buffers) plus counters (steps, round, rounds per
second). It travels as a byte stream, the arrays one after the other, each starting at a
multiple of ``ALIGN`` bytes (zeros between), so that no chunk (a multiple of ``ALIGN`` bytes)
splits a value:

- the newcomer asks a source for its *manifest* (``state_request`` with ``manifest``); the source
  answers ``state_manifest``: the versioned layout (name, dtype, shape of each array), the
  counters and the total size;
- the newcomer then pulls the stream in chunks of ``chunk_bytes`` (``state_request`` with
  ``chunks``: the indices it wants), each answered by one ``state_chunk``. Credits bound what
  is in flight: a request says how many chunks the newcomer has settled (received, or given up
  on) from that source, and a source sends no more than ``MAX_WINDOW`` chunks beyond that, so
  it queues no more than its send window for an honest requester (``gossip.state.server`` says
  what bounds a dishonest one);
- chunks are kept as they arrive, so a stalled source costs only the chunks it still owed,
  asked of another source or again, never a restart; with several sources the chunks are
  spread over them (``gossip.state.fetch``).

A source reads each chunk from its live state when asked (it holds no copy of the whole state),
so the stream is not one instant's state: each chunk is the source's values at the moment it
was read, and with several sources each chunk is one member's. Gossip keeps members close, and
the newcomer's first rounds average it further: this is the state a newcomer needs, at the
link's speed, for the memory of a send window. The counters are what most sources state
(``agreed_counters``), so one source's lie does not set the newcomer's round; a source whose
layout differs from the first fitting one is not used.

The receiver checks the manifest (version, sizes, dtypes, counters in range) before it
allocates anything, and every chunk against it as it arrives (size, finite values), so a bad
chunk is pinned on the source that sent it; nothing touches the model before the whole is in.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np

from gossip.buffers.vector import all_finite, dtype_named
from gossip.messages import STATE_CHUNK, STATE_MANIFEST, STATE_VERSION, StateManifest

# the names of a state's arrays: "params", then BUFFER_PREFIX + each per-parameter buffer of the
# optimizer (momentum, Adam's moments), SCALAR_PREFIX + each of its one-value entries (Adam's step)
BUFFER_PREFIX, SCALAR_PREFIX = "optimizer.", "scalar."

JOINER_KINDS = (STATE_MANIFEST, STATE_CHUNK)  # what a newcomer receives
CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 256  # a source refuses smaller chunks: a message per few bytes
MAX_CHUNK_BYTES = 8 << 20
ALIGN = 8  # arrays start, and chunks end, at multiples of this: the widest value (float64, int64)
WINDOW = 16  # chunks a newcomer keeps requested and not yet received, per source
MAX_WINDOW = 32  # chunks a source sends beyond what the requester has settled (its send queue is 64)
MAX_COUNTER = 2**53  # counters (steps, rounds, rates) are non-negative and exact as floats
FAR_ROUNDS, FAR_S = 64, 60.0  # a source's round beyond both (rounds; s at the agreed rate) is a lie
_DTYPES = ("float16", "bfloat16", "float32", "float64", "int64")

Counters = Mapping[str, float]


def agreed_counters(stated: Sequence[Counters]) -> dict[str, float]:
    """Each counter as the sources of one state state it: the lower median of their values, so
    one source's lie among three moves no counter, and of two the smaller stands (a joiner that
    starts behind the mesh catches up; one ahead of every member mixes nothing until they come)."""
    names = dict.fromkeys(name for counters in stated for name in counters)
    return {name: statistics.median_low([c[name] for c in stated if name in c]) for name in names}


def far_from(stated: Counters, agreed: Counters) -> str:
    """How a source's ``round`` is far from the ``agreed`` one (more than ``FAR_S`` of the
    agreed rate of rounds, and ``FAR_ROUNDS``), or "" when it is not."""
    theirs, ours = stated.get("round", 0), agreed.get("round", 0)
    if abs(theirs - ours) <= max(FAR_ROUNDS, FAR_S * agreed.get("rounds_per_s", 0)):
        return ""
    return f"it stated round {theirs:g}, the sources agree on {ours:g}"


class StateTransferError(RuntimeError):
    """No valid state arrived; the message says from whom and why, ``dropped`` which sources
    were left out (by id: why)."""

    dropped: dict[str, str] = {}  # noqa: RUF012 - replaced per instance, never mutated


@dataclass(frozen=True)
class Entry:
    """One array of a state: its name, dtype and shape."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)

    @property
    def span(self) -> int:
        """Its bytes in the stream, with the zeros that align the next array."""
        return -(-self.nbytes // ALIGN) * ALIGN

    def wire(self) -> list[Any]:
        return [self.name, self.dtype.name, list(self.shape)]


class StateView(Protocol):
    """A state as a source serves it: its layout and counters now, and any byte range of the
    stream read when asked (a copy: it goes on the wire while training changes the state)."""

    def manifest(self) -> tuple[Sequence[Entry], Counters]: ...

    def read(self, start: int, stop: int) -> np.ndarray:
        """Bytes ``start:stop`` of the stream (arrays aligned as the module docstring says), as
        a new uint8 array."""
        ...


@dataclass(frozen=True)
class Snapshot:
    """Named arrays plus counters (``steps``, ``round``, ``rounds_per_s``...): a state
    received whole, a checkpoint's, or one to serve as it is (a ``StateView``)."""

    tensors: Mapping[str, np.ndarray]
    counters: Counters

    def manifest(self) -> tuple[Sequence[Entry], Counters]:
        return [Entry(n, a.dtype, a.shape) for n, a in self.tensors.items()], self.counters

    def read(self, start: int, stop: int) -> np.ndarray:
        arrays = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in self.tensors.values()]
        return read_stream([(a.size, partial(_bytes_of, a)) for a in arrays], start, stop)


Reader = Callable[[int, int], np.ndarray]  # bytes lo:hi of one array


def _bytes_of(raw: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return raw[lo:hi]


def read_stream(arrays: Sequence[tuple[int, Reader]], start: int, stop: int) -> np.ndarray:
    """Bytes ``start:stop`` of the stream of ``arrays`` ((bytes, reader) each), as a new uint8
    array: each array starts at a multiple of ``ALIGN``, zeros between."""
    out, offset = np.zeros(stop - start, np.uint8), 0
    for nbytes, read in arrays:
        lo, hi = max(start - offset, 0), min(stop - offset, nbytes)
        if lo < hi:
            out[offset + lo - start : offset + hi - start] = read(lo, hi)
        offset += -(-nbytes // ALIGN) * ALIGN
    if stop > offset:
        raise ValueError(f"bytes {start}:{stop} are beyond the state's {offset}")
    return out


def split(entries: Sequence[Entry], raw: np.ndarray) -> dict[str, np.ndarray]:
    """The arrays of the byte stream ``raw`` (views of it)."""
    tensors, offset = {}, 0
    for entry in entries:
        tensors[entry.name] = raw[offset : offset + entry.nbytes].view(entry.dtype).reshape(entry.shape)
        offset += entry.span
    return tensors


@dataclass(frozen=True)
class Manifest:
    """A source's answer to a manifest request, checked."""

    entries: tuple[Entry, ...]
    counters: dict[str, float]
    total: int

    def chunks(self, chunk_bytes: int) -> int:
        return max(1, math.ceil(self.total / chunk_bytes))

    @classmethod
    def message(cls, entries: Sequence[Entry], counters: Counters, transfer: int) -> StateManifest:
        """The manifest message's payload."""
        return StateManifest(
            transfer=transfer,
            version=STATE_VERSION,
            layout=[entry.wire() for entry in entries],
            counters=dict(counters),
            total=sum(entry.span for entry in entries),
        )

    @classmethod
    def parse(cls, payload: StateManifest, max_bytes: int) -> Manifest:
        """Raises ValueError with what is wrong (its version and types are checked already)."""
        total, counters = payload.total, payload.counters
        if not 0 <= total <= max_bytes:
            raise ValueError(f"total size {total!r} is not in 0..{max_bytes}")
        if not all(type(v) in (int, float) and 0 <= v <= MAX_COUNTER for v in counters.values()):
            raise ValueError(f"counters must map names to numbers in 0..{MAX_COUNTER}")
        entries = []
        for entry in payload.layout:
            if (
                not isinstance(entry, list)
                or len(entry) != 3
                or not isinstance(entry[0], str)
                or entry[1] not in _DTYPES
                or not isinstance(entry[2], list)
                or not all(type(d) is int and d >= 0 for d in entry[2])
            ):
                raise ValueError(f"bad layout entry {shown(entry)}")
            entries.append(Entry(entry[0], dtype_named(entry[1]), tuple(entry[2])))
        if sum(entry.span for entry in entries) != total:
            raise ValueError("the layout does not add up to the total size")
        return cls(tuple(entries), dict(counters), total)


class StateSink(Protocol):
    """Where a state being received goes, chunk by chunk as it arrives."""

    def write(self, entry: Entry, first: int, values: np.ndarray) -> None:
        """Elements ``first...`` of array ``entry``: ``values``, of its dtype, checked."""
        ...

    def tensors(self) -> dict[str, np.ndarray]:
        """The arrays it holds once every chunk is in (none for one that writes them in place)."""
        ...


class StateBuffer:
    """A sink that holds the state whole, in a buffer of the manifest's size: for a state
    taken as it is (tests, tools); a joiner writes straight into its model instead."""

    def __init__(self, manifest: Manifest) -> None:
        self._entries = manifest.entries
        self._buffer = np.empty(manifest.total, np.uint8)
        self._offsets = dict(zip((e.name for e in self._entries), _offsets(self._entries), strict=True))

    def write(self, entry: Entry, first: int, values: np.ndarray) -> None:
        start = self._offsets[entry.name] + first * entry.dtype.itemsize
        self._buffer[start : start + values.nbytes] = values.reshape(-1).view(np.uint8)

    def tensors(self) -> dict[str, np.ndarray]:
        return split(self._entries, self._buffer)


class Discard:
    """A sink that lets every chunk go: a node that has trained further than the state it is
    sent (one resumed from its checkpoint) takes only the counters."""

    def write(self, entry: Entry, first: int, values: np.ndarray) -> None:
        """Nothing: the chunk is let go."""

    def tensors(self) -> dict[str, np.ndarray]:
        return {}


class Assembly:
    """A state being received: chunks, in any order, each checked whole and then written to
    ``sink`` (default: a :class:`StateBuffer`) array by array."""

    def __init__(self, manifest: Manifest, chunk_bytes: int, sink: StateSink | None = None) -> None:
        self.manifest = manifest
        self.chunk_bytes = chunk_bytes
        self.count = manifest.chunks(chunk_bytes)
        self.sink = sink if sink is not None else StateBuffer(manifest)
        self.seen: set[int] = set()

    @property
    def complete(self) -> bool:
        return len(self.seen) == self.count

    def add(self, index: Any, tensors: Sequence[np.ndarray]) -> bool:
        """Put chunk ``index`` in place; False for one already in. Raises ValueError for a
        chunk that is not one of this state's, or that carries a NaN or infinite value (then
        none of it is written)."""
        if type(index) is not int or not 0 <= index < self.count or len(tensors) != 1:
            raise ValueError(f"bad chunk {shown(index)}")
        if index in self.seen:
            return False
        start = index * self.chunk_bytes
        stop = min(start + self.chunk_bytes, self.manifest.total)
        piece = tensors[0]
        if piece.dtype != np.uint8 or piece.shape != (stop - start,):
            raise ValueError(f"chunk {index} has the wrong size")
        parts = []
        for entry, offset in zip(self.manifest.entries, _offsets(self.manifest.entries), strict=True):
            lo, hi = max(start, offset), min(stop, offset + entry.nbytes)  # (aligned: no value split)
            if lo < hi:
                values = piece[lo - start : hi - start].view(entry.dtype)
                finite = entry.dtype.kind not in "fV" or all_finite(
                    values.astype(np.float32) if entry.dtype.name == "bfloat16" else values
                )
                if not finite:
                    raise ValueError(f"{entry.name} has NaN or infinite values (chunk {index})")
                parts.append((entry, (lo - offset) // entry.dtype.itemsize, values))
        for entry, first, values in parts:
            self.sink.write(entry, first, values)
        self.seen.add(index)
        return True

    def snapshot(self) -> Snapshot:
        """What the sink holds (every chunk was checked as it came), with the manifest's counters."""
        return Snapshot(self.sink.tensors(), self.manifest.counters)


def _offsets(entries: Sequence[Entry]) -> list[int]:
    """Where each array starts in the stream."""
    return list(itertools.accumulate((entry.span for entry in entries[:-1]), initial=0))


Layout = Iterable[tuple[str, np.dtype, tuple[int, ...]]]  # name, dtype and shape of each array


def check_fit(layout: Layout, values: np.ndarray, params: np.ndarray, tensors: int) -> None:
    """Raise StateTransferError unless a state of ``layout`` (name, dtype, shape of each array)
    fits a model whose flat values (parameters, then averaged buffers) are ``values``, of which
    the parameters are ``params``, made of ``tensors`` tensors: "params" like ``values``,
    optimizer buffers like ``params``, a float64 scalar per tensor (Adam's step count)."""
    names = set()
    for name, dtype, shape in layout:
        names.add(name)
        if name.startswith(SCALAR_PREFIX):
            expected_dtype, expected_shape = np.dtype(np.float64), (tensors,)  # one value a parameter
        elif name == "params":
            expected_dtype, expected_shape = values.dtype, values.shape
        elif name.startswith(BUFFER_PREFIX):
            expected_dtype, expected_shape = params.dtype, params.shape
        else:
            raise StateTransferError(f"unknown snapshot tensor {name!r}")
        if tuple(shape) != expected_shape or dtype != expected_dtype:
            needs = f"{expected_dtype}{list(expected_shape)}"
            raise StateTransferError(f"snapshot {name} is {dtype}{list(shape)}; this model needs {needs}")
    if "params" not in names:
        raise StateTransferError("the snapshot has no parameters")


def shown(value: Any, limit: int = 80) -> str:
    """A received value in an error message, bounded."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
