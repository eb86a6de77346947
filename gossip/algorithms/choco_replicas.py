"""What a CHOCO node holds of its neighbours' public copies: a replica per neighbour (its value in
an array of its own, or its share of the sum of them all), the q's kept for it until their turn,
and the q's arriving piece by piece (``gossip.algorithms.choco``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gossip.buffers.arrays import Array, array_module, own_memory
from gossip.buffers.vector import all_finite
from gossip.compression import Codec, StreamedDecode

# q's kept for a replica waiting for its full copy (beyond that, ask again), and how many rounds
# ahead of this node a q may be: a neighbour holds at most MAX_PENDING + 1 of them here
MAX_PENDING = 64
# a q none of whose pieces came for this many round timeouts was cut off (10 s at the default,
# when the transport forgets a stream that idle)
STREAM_IDLE_ROUND_TIMEOUTS = 5


@dataclass(frozen=True)
class Update:
    """A neighbour's q as it came, checked but not decoded (int8: a quarter of its decoded
    bytes): decoded into its replica when its turn comes."""

    codec: Codec
    frames: Sequence[Array]
    meta: Mapping[str, Any]
    gamma: float  # the sender's γ at its round


@dataclass
class Streaming:
    """A neighbour's q of ``round`` being added into the sum as its pieces arrive."""

    round: int
    decode: StreamedDecode
    gamma: float
    heard: float  # when its last piece came (peer.now() s)


@dataclass
class Assembly:
    """A neighbour's q of ``round`` whose pieces are put together whole, to be kept as it came
    (for a replica that waits for its full copy, or after a gap)."""

    round: int
    gamma: float
    specs: Sequence[tuple[Any, Any, int]]
    payload: np.ndarray  # uint8
    received: int = 0

    def frames(self) -> list[np.ndarray]:
        starts = [0, *itertools.accumulate(nbytes for _, _, nbytes in self.specs)]
        return [
            self.payload[lo:hi].view(dtype).reshape(shape)
            for (dtype, shape, _), lo, hi in zip(self.specs, starts[:-1], starts[1:], strict=True)
        ]


@dataclass
class Replica:
    """A neighbour's public copy as this node holds it, at the version of one round: in an array
    of its own, or weighed into the sum of the neighbours' copies (:class:`CHOCO`)."""

    value: Array | None = None  # what its q's are added to (on this node's device); None until it starts
    weight: float = 1.0  # what its q's are scaled by there
    next_round: int = 0  # the round of the next q to add (the value is that of the round before)
    gamma: float = 1.0  # the sender's γ at the value's round
    pending: dict[int, Update] = field(default_factory=dict)  # the q's not added yet, by round
    asked_at: float = -math.inf  # when the full copy was last requested (peer.now() s)

    def catch_up(self, upto: int) -> bool:
        """Add the pending q's of rounds up to ``upto`` that follow on without a gap; False when
        that made the value non-finite (then it is dropped: the full copy is asked again)."""
        if self.value is None:
            return True
        start = self.next_round
        with np.errstate(over="ignore"):  # an overflow is what the check below catches
            while self.next_round <= upto and (q := self.pending.pop(self.next_round, None)) is not None:
                q.codec.add_decoded(self.value, q.frames, q.meta, self.weight)
                self.gamma = q.gamma
                self.next_round += 1
        if self.next_round == start or all_finite(self.value):
            return True
        self.value = None
        return False

    @property
    def has_gap(self) -> bool:
        """A q is missing before the ones pending (they come in order from one sender)."""
        return bool(self.pending) and min(self.pending) != self.next_round


def owned(value: Array, like: Array) -> Array:
    """``value`` (a received full copy) to keep and add to: itself where its memory is its own
    and of ``like``'s kind and dtype (a large message's reassembly buffer), else a copy."""
    if isinstance(value, type(like)) and value.dtype == like.dtype and (own := own_memory(value)) is not None:
        return own
    return array_module(like).array(value, dtype=like.dtype)
