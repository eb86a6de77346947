"""Reassembly of messages that come as streams of chunks (see ``p2p.wire.encode_chunks``).

Chunks of one sender arrive in order (one connection), so a stream is a sequence: chunk 0
allocates the tensors (sizes already checked against the node's limits by the decoder), each
next chunk is copied into place as it arrives, and the last one yields the whole message. The
copy from the socket's frame into the tensor is the only one on the receiving side, and it
overlaps with the next chunk's transfer. A chunk out of sequence (one was dropped on the way,
or the sender restarted) discards its stream; a new stream from the same sender replaces an
unfinished one. Memory: one message being assembled per sender (a sender is the peer the
transport names: its CURVE key, not the id it claims), at most ``max_streams`` at once (more
are refused), and none for longer than ``idle_s`` without a chunk (a sender killed mid-stream
leaves nothing behind).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from p2p.wire import Chunk, Message, WireError

MAX_STREAMS = 32
IDLE_S = 10.0


class _Stream:
    def __init__(self, first: Chunk, now: float) -> None:
        self.first = first
        self.heard = now
        self.tensors = [np.empty(shape, dtype) for dtype, shape, _ in first.specs]
        self._views = [t.reshape(-1).view(np.uint8) for t in self.tensors]
        self._ends = list(itertools.accumulate(v.size for v in self._views))
        self.received = 0  # payload bytes copied in
        self.next_index = 0

    def continues(self, chunk: Chunk) -> bool:
        head, message = self.first.message, chunk.message
        return (
            chunk.index == self.next_index
            and chunk.offset == self.received
            and chunk.count == self.first.count
            and chunk.specs == self.first.specs
            and (message.kind, message.round, message.session) == (head.kind, head.round, head.session)
        )

    def write(self, chunk: Chunk) -> None:
        """Copy the chunk's pieces to their place in the tensors."""
        for piece in chunk.pieces:
            data = np.frombuffer(piece, dtype=np.uint8)
            while data.size:
                i = bisect.bisect_right(self._ends, self.received)
                view = self._views[i]
                start = self.received - (self._ends[i] - view.size)
                n = min(data.size, view.size - start)
                view[start : start + n] = data[:n]
                data = data[n:]
                self.received += n
        self.next_index += 1

    @property
    def complete(self) -> bool:
        return self.next_index == self.first.count


class Assembler:
    """Streams being received, one per sender."""

    def __init__(
        self,
        *,
        max_streams: int = MAX_STREAMS,
        idle_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._streams: dict[str, _Stream] = {}
        self._max_streams = max_streams
        self._idle_s = IDLE_S if idle_s is None else idle_s
        self._clock = clock

    def add(self, chunk: Chunk, sender: str | None = None) -> Message | None:
        """Take one chunk of ``sender`` (default: the id the chunk claims); the whole message
        once its last chunk is in. Raises WireError: ``chunk_sequence`` for a chunk that does
        not continue its sender's stream, ``too_many_streams`` for a new stream beyond the cap."""
        sender = chunk.message.sender if sender is None else sender
        now = self._clock()
        if chunk.index == 0:
            self._streams.pop(sender, None)
            self.expire(now)
            if len(self._streams) >= self._max_streams:
                raise WireError("too_many_streams", f"{len(self._streams)} streams are being received")
            self._streams[sender] = _Stream(chunk, now)
        stream = self._streams.get(sender)
        if stream is None or not stream.continues(chunk):
            self._streams.pop(sender, None)
            raise WireError("chunk_sequence", f"chunk {chunk.index} of {chunk.count} out of sequence")
        stream.heard = now
        stream.write(chunk)
        if not stream.complete:
            return None
        del self._streams[sender]
        if stream.received != chunk.total:
            raise WireError(
                "chunk_sequence", f"{stream.received} of {chunk.total} bytes in {chunk.count} chunks"
            )
        for tensor in stream.tensors:
            tensor.flags.writeable = False
        return replace(chunk.message, tensors=tuple(stream.tensors))

    def expire(self, now: float) -> None:
        """Forget the streams that have had no chunk for ``idle_s``."""
        for sender in [s for s, stream in self._streams.items() if now - stream.heard > self._idle_s]:
            del self._streams[sender]

    @property
    def in_progress(self) -> int:
        """Streams started and not finished."""
        return len(self._streams)

    @property
    def held_bytes(self) -> int:
        """Memory held for the streams in progress (their whole messages, allocated at chunk 0)."""
        return sum(stream.first.total for stream in list(self._streams.values()))
