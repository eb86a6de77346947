"""Reassembly of messages that come as streams of chunks (see ``p2p.wire.encode_chunks``).

Chunk 0 (or whichever comes first) allocates the tensors (sizes already checked against the
node's limits by the decoder), each chunk is copied into its place as it arrives, and the last
one in yields the whole message. The copy from the socket's frame into the tensor is the only
one on the receiving side, and it overlaps with the next chunk's transfer. Chunks may come in
any order: a sender with several connections to a node (``--streams``) spreads a stream's
chunks over them. A stream is named by its sender, session and first seq (a stream's chunks
take consecutive seqs); every chunk but the last is as long as the others and sits at its index
times that length, the last ends the payload, no index comes twice: so the chunks tile the
tensors exactly, whatever order they come in, and a message is never yielded with a byte left
unwritten.

A stream of a kind its reader takes piece by piece (:meth:`Assembler.piece`) is checked the same
way, chunk by chunk, but never copied: each chunk goes on as a message of its own, its tensors
the chunk's bytes as they came and its ``piece`` saying where they sit (the reader mixes them in
as they come: ``gossip.buffers.pieces``). Nothing is allocated for such a stream.

Memory: at most ``max_streams`` streams at once (more are refused), ``MAX_STREAMS_PER_SENDER``
per sender (beyond, its oldest is dropped and its late chunks ignored), and none for longer
than ``idle_s`` without a chunk (a sender killed mid-stream leaves nothing behind). A sender is
the peer the transport names: its CURVE key, not the id it claims.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from p2p.security.ratelimit import lru_entry
from p2p.wire import Chunk, Message, Piece, WireError

MAX_STREAMS = 32
MAX_STREAMS_PER_SENDER = 4  # (a stream finishing on some connections while the next begins)
MAX_SENDERS = 4096  # senders whose dropped streams are remembered
IDLE_S = 10.0

StreamName = tuple[str, int, int]  # sender, session, first seq


def stream_name(chunk: Chunk, sender: str | None = None) -> StreamName:
    """A stream's name: its sender (default: the one the chunk claims), session and first seq."""
    return (
        chunk.message.sender if sender is None else sender,
        chunk.message.session,
        chunk.message.seq - chunk.index,
    )


class _Stream:
    def __init__(self, first: Chunk, now: float, *, assembled: bool) -> None:
        self.first = replace(first, pieces=())  # (its bytes are the reader's to release)
        self.heard = now
        self.tensors = [np.empty(shape, dtype) for dtype, shape, _ in first.specs] if assembled else []
        self._views = [t.reshape(-1).view(np.uint8) for t in self.tensors]
        self._ends = list(itertools.accumulate(v.size for v in self._views))
        self.indices: set[int] = set()  # the chunks taken (copied in, when assembled)
        self.stride: int | None = None  # every chunk's length but the last's, once one is in

    def place(self, chunk: Chunk) -> int | None:
        """The stride at which ``chunk`` is one of this stream's not yet in, at its place (see
        above); None when it is not."""
        head, message = self.first.message, chunk.message
        if (
            chunk.index in self.indices
            or chunk.count != self.first.count
            or chunk.specs != self.first.specs
            or (message.kind, message.round, message.session) != (head.kind, head.round, head.session)
        ):
            return None
        last = chunk.index == chunk.count - 1
        if last and chunk.index:
            stride, uneven = divmod(chunk.offset, chunk.index)
            if uneven:
                return None
        else:
            stride = chunk.total if last else chunk.nbytes
        tiles = stride > 0 and (chunk.count - 1) * stride < chunk.total <= chunk.count * stride
        if (
            not tiles
            or (self.stride is not None and stride != self.stride)
            or chunk.offset != chunk.index * stride
        ):
            return None
        return stride if not last or chunk.offset + chunk.nbytes == chunk.total else None

    def take(self, chunk: Chunk, stride: int) -> None:
        """Count the chunk in, at ``stride``."""
        self.indices.add(chunk.index)
        self.stride = stride

    def write(self, chunk: Chunk, stride: int) -> None:
        """Copy the chunk's pieces to their place in the tensors."""
        position = chunk.offset
        for piece in chunk.pieces:
            data = np.frombuffer(piece, dtype=np.uint8)
            while data.size:
                i = bisect.bisect_right(self._ends, position)
                view = self._views[i]
                start = position - (self._ends[i] - view.size)
                n = min(data.size, view.size - start)
                view[start : start + n] = data[:n]
                data = data[n:]
                position += n
        self.take(chunk, stride)

    @property
    def complete(self) -> bool:
        return len(self.indices) == self.first.count


class Assembler:
    """Streams being received."""

    def __init__(
        self,
        *,
        max_streams: int = MAX_STREAMS,
        idle_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._streams: dict[StreamName, _Stream] = {}
        self._dropped: OrderedDict[str, deque[StreamName]] = OrderedDict()  # per sender: recent
        self._max_streams = max_streams
        self._idle_s = IDLE_S if idle_s is None else idle_s
        self._clock = clock

    def add(self, chunk: Chunk, sender: str | None = None) -> Message | None:
        """Take one chunk of ``sender`` (default: the id the chunk claims); the whole message
        once its last chunk is in. Raises WireError: ``chunk_sequence`` for a chunk that does
        not fit its stream, ``too_many_streams`` for a new stream beyond the cap."""
        placed = self._place(chunk, sender, assembled=True)
        if placed is None:
            return None
        name, stream, stride = placed
        stream.write(chunk, stride)
        if not stream.complete:
            return None
        del self._streams[name]
        for tensor in stream.tensors:
            tensor.flags.writeable = False
        return replace(chunk.message, tensors=tuple(stream.tensors))

    def piece(self, chunk: Chunk, sender: str | None = None) -> Message | None:
        """The chunk as a message of its own (its ``piece`` says where it sits), once checked
        against its stream as :meth:`add` checks it; None for a late chunk of a dropped stream.
        A stream that began to be assembled (before its reader asked for pieces) is finished
        so, and comes whole."""
        stream = self._streams.get(stream_name(chunk, sender))
        if stream is not None and stream.tensors:
            return self.add(chunk, sender)
        placed = self._place(chunk, sender, assembled=False)
        if placed is None:
            return None
        name, stream, stride = placed
        stream.take(chunk, stride)
        if stream.complete:
            del self._streams[name]
        pieces = tuple(np.frombuffer(piece, dtype=np.uint8) for piece in chunk.pieces)
        return replace(chunk.message, tensors=pieces, piece=Piece(chunk.offset, chunk.specs))

    def _place(
        self, chunk: Chunk, sender: str | None, *, assembled: bool
    ) -> tuple[StreamName, _Stream, int] | None:
        """The chunk's stream (started by its first chunk to come) and its stride there."""
        name = stream_name(chunk, sender)
        sender = name[0]
        now = self._clock()
        stream = self._streams.get(name)
        if stream is None:
            if name in self._dropped.get(sender, ()):
                return None  # a late chunk of a stream dropped for a newer one: nothing to do
            stream = self._start(name, chunk, now, assembled)
        stride = stream.place(chunk)
        if stride is None:
            self._drop(name)
            raise WireError("chunk_sequence", f"chunk {chunk.index} of {chunk.count} does not fit its stream")
        stream.heard = now
        return name, stream, stride

    def _start(self, name: StreamName, chunk: Chunk, now: float, assembled: bool) -> _Stream:
        self.expire(now)
        mine = sorted(n for n in self._streams if n[0] == name[0])
        for older in mine[: max(0, len(mine) - MAX_STREAMS_PER_SENDER + 1)]:
            self._drop(older)
        if len(self._streams) >= self._max_streams:
            raise WireError("too_many_streams", f"{len(self._streams)} streams are being received")
        stream = self._streams[name] = _Stream(chunk, now, assembled=assembled)
        return stream

    def _drop(self, name: StreamName) -> None:
        self._streams.pop(name, None)
        dropped = lru_entry(self._dropped, name[0], lambda: deque(maxlen=MAX_STREAMS_PER_SENDER), MAX_SENDERS)
        dropped.append(name)

    def expire(self, now: float) -> None:
        """Forget the streams that have had no chunk for ``idle_s``."""
        for name in [n for n, stream in self._streams.items() if now - stream.heard > self._idle_s]:
            self._drop(name)

    @property
    def in_progress(self) -> int:
        """Streams started and not finished."""
        return len(self._streams)

    @property
    def held_bytes(self) -> int:
        """Memory held for the streams in progress (their whole messages, allocated at chunk 0)."""
        return sum(stream.first.total for stream in list(self._streams.values()) if stream.tensors)
