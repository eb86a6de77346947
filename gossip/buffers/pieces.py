"""Mixing neighbours' values into the model piece by piece, as they arrive.

A large message reaches the algorithm as pieces (``PeerNetwork.take_pieces``): bytes
``offset...`` of its payload, the frames of a :class:`~gossip.buffers.vector.Layout`. A
:class:`RunningMix` mixes each piece into the node's vector as it comes, keeping every element
a convex combination of what has arrived for it at every moment::

    x[e] <- (W[e] x[e] + w v[e]) / (W[e] + w)

where ``w`` is the sender's weight and ``W[e]`` the weight mixed in at element ``e`` so far
(the node's own weight to begin with). Both may differ from one segment of the vector to the
next: push-sum's weights (SGP) are per element where a share was cut off mid-message, and a mix
may begin from, and a sender state, such a list of segments. When every value arrived, ``x`` is
the row's weighted mean; a neighbour cut off mid-message counts exactly where its pieces arrived, and
nowhere else, with the weights renormalised there. No message is held: what a node adds for a
round is the pieces waiting to be mixed, and a reader of the model (evaluation, a joiner's
state) sees a proper mix at any moment.

Each piece is checked before it touches the model, block by block in the same pass as the
mixing: its frames must be the layout's, its bounds whole elements, its values finite. A bad
block ends what is taken of that message (the blocks before it stay, counted where they are);
the other senders' messages are not affected. A value that came whole (small, or over an
in-memory network) is checked whole first, and taken whole or not at all.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, TypeAlias

import numpy as np

from gossip.buffers.vector import Layout, all_finite, mix_into

#: weights by segment of a vector: (first element, weight from there on), the first at element 0
Segments: TypeAlias = Sequence[tuple[int, float]]


class Piece(Protocol):
    """Where a piece of a message sits: its tensors are bytes ``offset...`` of the payload of
    tensors ``specs`` (dtype, shape, bytes), one after the other."""

    @property
    def offset(self) -> int: ...
    @property
    def specs(self) -> Sequence[tuple[np.dtype, tuple[int, ...], int]]: ...


class Coverage:
    """Which payload bytes of each message were mixed in, and which messages were refused. A
    mix keeps its own; an algorithm whose messages may span several mixes (SGP mixes what has
    arrived and goes on) keeps one across them."""

    def __init__(self) -> None:
        self.taken: dict[Hashable, list[tuple[int, int]]] = {}  # message -> payload bytes mixed
        self.refused: set[Hashable] = set()

    def forget(self, old: Callable[[Hashable], bool]) -> None:
        """Drop what is known of the messages ``old`` names (none of their pieces may come again)."""
        for key in [k for k in self.taken if old(k)]:
            del self.taken[key]
        self.refused = {key for key in self.refused if not old(key)}


class RunningMix:
    """One round's mix into ``params`` (see the module docstring).

    Args:
        params: the node's vector, mixed in place (its own value when the round begins).
        layout: how neighbours' values go on the wire.
        self_weight: the node's own weight in the round's row, one for the vector or by segment.
        scratch: a buffer of ``params``' mixing dtype (``gossip.buffers.vector.scratch_for``:
            a block of the vector, mixed at a time).
        lock: held while a block of ``params`` is written.
        coverage: what is known of the messages (default: this mix's own).
    """

    def __init__(
        self,
        params: np.ndarray,
        layout: Layout,
        self_weight: float | Segments,
        scratch: np.ndarray,
        lock: AbstractContextManager[object],
        coverage: Coverage | None = None,
    ) -> None:
        self._params = params
        self._layout = layout
        self._scratch = scratch
        self._lock = lock
        self._specs = [(np.dtype(d), (n,), n * np.dtype(d).itemsize) for d, n in layout.buckets]
        self._frame_bytes = np.cumsum([0, *(nbytes for _, _, nbytes in self._specs)])
        self._frame_elements = np.cumsum([0, *(n for _, n in layout.buckets)])
        segments = [(0, self_weight)] if isinstance(self_weight, float | int) else self_weight
        # the weight mixed in is _weights[i] from element _starts[i] on
        self._starts = [int(start) for start, _ in segments]
        self._weights = [float(weight) for _, weight in segments]
        self._coverage = coverage if coverage is not None else Coverage()
        self._mixed: set[Hashable] = set()  # the messages this mix took bytes of

    @property
    def senders(self) -> set[Hashable]:
        """The messages (senders, for a mix of one round) this mix took bytes of."""
        return set(self._mixed)

    def complete(self, sender: Hashable) -> bool:
        """Whether all of ``sender``'s value is mixed in."""
        total = int(self._frame_bytes[-1])
        return sum(hi - lo for lo, hi in self._coverage.taken.get(sender, ())) == total

    def add(
        self,
        sender: Hashable,
        tensors: Sequence[np.ndarray],
        piece: Piece | None,
        weight: float | Segments,
    ) -> str | None:
        """Mix in ``sender``'s value, whole (``tensors`` are its frames) or one ``piece`` of it
        (``tensors`` are its bytes), with ``weight`` (one, or by segment of the vector); the
        reason it was refused (in part: from its first bad block on), or None."""
        if sender in self._coverage.refused:
            return "refused_message"
        if piece is None:  # a whole value: checked whole, taken whole or not at all
            problem = self._layout.problem(tensors)
            if problem is None and not all(all_finite(t) for t in tensors):
                problem = "non_finite"
            if problem is not None:
                return problem
            data, offset = [np.asarray(t).reshape(-1).view(np.uint8) for t in tensors], 0
        else:
            if [(np.dtype(d), tuple(s), n) for d, s, n in piece.specs] != self._specs:
                return self._refuse(sender, "tensor_mismatch")
            data, offset = list(tensors), piece.offset
        stop = offset + sum(part.nbytes for part in data)
        if any(lo < stop and offset < hi for lo, hi in self._coverage.taken.get(sender, ())):
            return "duplicate_piece" if piece is None else self._refuse(sender, "duplicate_piece")
        segments = [(0, weight)] if isinstance(weight, float | int) else weight
        starts, weights = [int(start) for start, _ in segments], [float(w) for _, w in segments]
        for part in data:
            problem = self._add_bytes(sender, part, offset, (starts, weights))
            if problem is not None:
                return self._refuse(sender, problem)
            offset += part.nbytes
        return None

    def _refuse(self, sender: Hashable, reason: str) -> str:
        self._coverage.refused.add(sender)
        return reason

    def _add_bytes(
        self, sender: Hashable, data: np.ndarray, offset: int, weight: tuple[list[int], list[float]]
    ) -> str | None:
        """Mix bytes ``offset...`` of the payload (possibly across frames)."""
        base, end = offset, offset + data.size  # (data[0] is payload byte ``base``)
        if data.dtype != np.uint8 or end > self._frame_bytes[-1]:
            return "piece_out_of_bounds"
        while offset < end:
            frame = int(np.searchsorted(self._frame_bytes, offset, side="right")) - 1
            dtype = self._specs[frame][0]
            lo = offset - int(self._frame_bytes[frame])
            hi = min(end, int(self._frame_bytes[frame + 1])) - int(self._frame_bytes[frame])
            if lo % dtype.itemsize or hi % dtype.itemsize:
                return "piece_misaligned"
            values = data[offset - base : offset - base + hi - lo].view(dtype)
            first = int(self._frame_elements[frame]) + lo // dtype.itemsize
            mixed = self._mix(values, first, weight)
            self._cover(sender, offset, offset + mixed * dtype.itemsize)
            if mixed < values.size:
                return "non_finite"
            offset += hi - lo
        return None

    def _mix(self, values: np.ndarray, first: int, incoming: tuple[list[int], list[float]]) -> int:
        """Mix ``values`` into elements ``first...`` with the sender's weights ``incoming`` (by
        segment), block by block, each checked finite first; how many were mixed (all, or up
        to the first bad block)."""
        done = 0
        while done < values.size:
            start = first + done
            segment = bisect.bisect_right(self._starts, start) - 1
            theirs = bisect.bisect_right(incoming[0], start) - 1
            weight = incoming[1][theirs]
            stop = first + values.size
            if segment + 1 < len(self._starts):
                stop = min(stop, self._starts[segment + 1])
            if theirs + 1 < len(incoming[0]):
                stop = min(stop, incoming[0][theirs + 1])
            stop = min(stop, start + self._scratch.size)
            block = self._scratch[: stop - start]
            before = self._weights[segment]
            after = before + weight
            # the values scaled as they are read (widened first where they are narrower, so the
            # product is the block's dtype's); checked after: a scale in (0, 1] makes no finite
            # value infinite and leaves every infinite or NaN one so (0 makes them NaN)
            part = values[done : done + block.size]
            if part.dtype == block.dtype:
                np.multiply(part, weight / after, out=block)
            else:
                np.copyto(block, part, casting="same_kind")
                block *= weight / after
            if not np.isfinite(block).all():
                return done
            with self._lock:
                mix_into(self._params[start:stop], block, before / after)
            self._raise(start, stop, weight)
            done += block.size
        return done

    def _raise(self, start: int, stop: int, weight: float) -> None:
        """Add ``weight`` to what is mixed in at elements ``start:stop`` (one segment's part)."""
        for edge in (start, stop):
            index = bisect.bisect_right(self._starts, edge) - 1
            if self._starts[index] != edge and edge < self._params.size:
                self._starts.insert(index + 1, edge)
                self._weights.insert(index + 1, self._weights[index])
        index = bisect.bisect_left(self._starts, start)
        self._weights[index] += weight
        self._merge_around(index)

    def _merge_around(self, index: int) -> None:
        """Join neighbouring segments of equal weight (a value that arrived whole leaves one)."""
        for i in (index + 1, index):
            if 0 < i < len(self._starts) and self._weights[i] == self._weights[i - 1]:
                del self._starts[i], self._weights[i]

    def _cover(self, sender: Hashable, lo: int, hi: int) -> None:
        if hi > lo:
            ranges = self._coverage.taken.setdefault(sender, [])
            if ranges and ranges[-1][1] == lo:  # (pieces come in order: one range a message)
                ranges[-1] = (ranges[-1][0], hi)
            else:
                ranges.append((lo, hi))
            self._mixed.add(sender)

    @property
    def weights(self) -> Sequence[tuple[int, float]]:
        """(first element, weight mixed in from there on) of each segment of the vector."""
        return list(zip(self._starts, self._weights, strict=True))
