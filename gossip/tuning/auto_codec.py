"""Self-tuning compression (``Codec.parse("auto")``): the codec of each epoch of rounds chosen
from what the node measures, one codec for the whole mesh (``gossip.tuning.agreement``).

The rungs are :data:`gossip.compression.AUTO_LADDER`: float32, bfloat16, int8. After every
round a node records where the round's time went (``gossip.phases``): the compute since the
last round (its H local steps), the time spent sending and waiting for its neighbours'
updates, which grows with the bytes on the link, and the rest (encoding, decoding, mixing).
It proposes the least compressed rung at which rounds would take at most
:data:`~gossip.tuning.agreement.COMM_SHARE` of its time, reckoning each rung's sending and waiting
from the least time per byte among its recent rounds (the other rungs' bytes are known: the
same vector through their codec); if none would, the most compressed. A neighbour that is
always late (a slower node) looks like a slow link: that compresses more than needed, which
costs a dense codec little. A slow link or a large
model raises the compression and a fast link lowers it again; the mesh takes the most
compressed proposal, so every link of the mesh is within its budget. The first epoch runs at
the most compressed rung: safe on any link, and measured from there.

With ``average_every="auto"`` as well, H and the codec are agreed side by side: each proposal
sees the other's effect in the times it measures.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping

import numpy as np

from gossip.compression import AUTO_LADDER, INT8_BLOCK
from gossip.tuning.agreement import COMM_SHARE, RECENT, EpochAgreement

TRANSFER_PHASES = ("send", "wait")  # what grows with the bytes a round moves
FIXED_PHASES = ("encode", "decode", "mix")


def bytes_per_element() -> list[float]:
    """What each rung of the ladder puts on the wire per element of the vector."""
    probe = np.ones(4 * INT8_BLOCK, dtype=np.float32)
    return [codec.encode(probe).nbytes / probe.size for codec in AUTO_LADDER]


class CodecAgreement(EpochAgreement):
    """One node's side: its rounds' times and the rung they call for (``value_for(round)``: the
    rung of :data:`~gossip.compression.AUTO_LADDER` for ``round``)."""

    meta_key = "codec_agreement"  # ("codec" names each update's own codec)

    def __init__(self) -> None:
        top = len(AUTO_LADDER) - 1
        super().__init__(floor=0, cap=top, start=top)
        self._sizes = bytes_per_element()
        # per round: (compute s, transfer s per byte-per-element of its rung, the rest s)
        self._rounds: deque[tuple[float, float, float]] = deque(maxlen=RECENT)

    def observe(self, round: int, phases: Mapping[str, float]) -> None:
        """Round ``round``'s phase durations (``gossip.phases.PhaseTimer.last``), in seconds."""
        if "compute" not in phases or not phases["compute"]:
            return  # the first round has no compute before it to weigh against
        transfer = sum(phases.get(p, 0.0) for p in TRANSFER_PHASES)
        fixed = sum(phases.get(p, 0.0) for p in FIXED_PHASES)
        per_size = transfer / self._sizes[self.value_for(round)]
        self._rounds.append((phases["compute"], per_size, fixed))

    def proposal(self) -> int | None:
        """The least compressed rung within budget (None before a round was measured)."""
        if not self._rounds:
            return None
        computes, per_sizes, fixeds = zip(*self._rounds, strict=True)
        # the least transfer time seen: a round's wait also holds a neighbour's late start,
        # which varies from round to round; the time the bytes take does not
        compute, per_size, fixed = statistics.median(computes), min(per_sizes), statistics.median(fixeds)
        for level, size in enumerate(self._sizes):
            round_s = fixed + per_size * size
            if round_s <= COMM_SHARE * (round_s + compute):
                return level
        return self.cap
