"""Stochastic Gradient Push (Assran et al., ICML 2019): push-sum on directed, time-varying graphs.

Each node keeps a weight w and its de-biased model z (push-sum's numerator is x = w z). After a
local step (the optimizer's step moves z, as it would alone), the node keeps a share 1 / (d + 1)
of its weight and pushes (z, w / (d + 1)) to each of its d out-neighbours of the round (one per
round on the default one-peer exponential graph); a received share (z_j, w_j) is mixed in as
z <- (w z + w_j z_j) / (w + w_j), w <- w + w_j. Column-stochastic mixing conserves the sums of
x and w, so z tends to the true average even on directed graphs where no doubly-stochastic
weights exist.

The model, not the numerator, is what is stored and sent: a node that receives nothing for a
while (its in-neighbours stopped or fell behind) halves w every round, and a float32 numerator
x = w z loses its precision below 1e-38 and reaches 0/0 after about 150 such rounds; z mixed as a
weighted mean stays exact at any w.

``overlap`` is how many rounds a share may take to arrive: with 0 a node waits (bounded) for this
round's shares, with 1 (the default, the paper's 1-overlap SGP) it sends this round's shares and
waits only for those of the previous round, which have had a whole local step to arrive, so
communication hides behind computation. An in-neighbour that has fallen behind (its newest share is
older than that) is not waited for: waiting cannot make it faster, and push-sum does not need shares
to come in step. Nor, unless ``stragglers=wait``, is one whose shares arrive consistently later than
the others' (``gossip.algorithms.pace``): waited for, a slow node never falls behind, and the whole
mesh would run at its pace. Nor is one that has begun a later round's share without any of the
awaited one (it kept that share: it will not come). Tolerating, a node also keeps the share of an
out-neighbour whose link still carries an earlier push (``Pace.ready``) instead of queueing it
there: push-sum stays exact with the share kept, where a queued push arrives ever staler behind a
slow link and one dropped from a full queue takes its mass with it. So does one whose last push, to
any out-neighbour, still leaves while the copy it went out from is held: a node holds one push copy,
not one per push in flight. A share older than ``max_staleness`` rounds is dropped and counted. The
default bound is generous (256 rounds) because a dropped share takes its mass with it: push-sum is
exact only while mass is conserved, and a node that keeps losing mass drives its weight towards
zero.

Shares are mixed piece by piece as they arrive (``gossip.buffers.pieces``). A share from one of
the next ``HOLD_ROUNDS`` rounds waits for its round, so nodes in step mix exactly as the graph
says (push-sum on the one-peer exponential graph is exact in log2 n rounds), but only while the
pieces held add up to at most ``HOLD_MODELS`` models: past that, a share is mixed in as it comes,
as is any share from further ahead (push-sum's sums are conserved in whichever round a share is mixed; a
node that has fallen far behind takes in the mass the others push to it at once).
A share cut off mid-message (its sender died) leaves the elements it reached with more weight
than the rest, so w is kept by segment of the vector, and a share carries its weights by
segment in the header (:class:`~gossip.messages.PushShare`): every element stays an exact
push-sum of its own. A share still arriving when a round's mixing ends is mixed on in the next.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gossip.algorithms.averager import Averager, AveragerOptions, RoundStats
from gossip.algorithms.pace import pace_option
from gossip.buffers.pieces import Coverage, RunningMix, Segments
from gossip.buffers.vector import SendCopy
from gossip.messages import PUSH, PayloadError, PushShare
from gossip.network import Envelope, PeerNetwork
from topologies import mixing_row

if TYPE_CHECKING:  # (Python 3.11's typing; annotations are not evaluated)
    from typing import Unpack

HOLD_ROUNDS = 8
# shares held for their round, in models' bytes: on the one-peer exponential graph of 8 nodes in
# step, one node can be two rounds ahead of another whose share it sends
HOLD_MODELS = 2
MIN_WEIGHT = float(np.finfo(np.float64).tiny)
MAX_WEIGHT = 1e6  # a share's weight beyond this is a sender's lie: all the mesh's mass is n
MAX_SEGMENTS = 1024  # weight segments a share may carry
# neighbouring segments whose weights differ by less than this (relative) are joined: push-sum
# drives every element's weight to the same value, and the boundaries of a share cut off long
# ago would otherwise stay for ever
JOIN_TOLERANCE = 1e-6


class SGP(Averager):
    """Args are those of :class:`~gossip.algorithms.averager.Averager`, plus ``overlap`` and
    ``stragglers`` (``tolerate``, the default: see above; ``wait``: wait, bounded, for every
    in-neighbour's share, as the rounds of a synchronous mesh do)."""

    name: ClassVar[str] = "sgp"
    kinds: ClassVar[tuple[str, ...]] = (PUSH,)

    def __init__(
        self,
        peer: PeerNetwork,
        params: np.ndarray,
        *,
        max_staleness: int = 256,
        overlap: int = 1,
        stragglers: str = "tolerate",
        **common: Unpack[AveragerOptions],
    ) -> None:
        super().__init__(peer, params, max_staleness=max_staleness, **common)
        self.overlap = overlap
        self.segments: list[tuple[int, float]] = [(0, 1.0)]  # w by segment (z is ``params``)
        self._coverage = Coverage()  # of the shares, keyed (sender, round), over rounds
        self._newest: dict[str, int] = {}  # sender -> round of its newest share
        self._later: list[Envelope] = []  # pieces of shares for rounds this node has not reached
        self._later_bytes = 0
        self._push_copy = SendCopy(self.vector_layout)  # (shares: the vector as it is)
        self._pushed_to: list[str] = []  # the targets of the last push
        self.pace = pace_option(self.name, stragglers, catch_up=0, holds_back=True)
        peer.take_pieces(self.piece_kinds({}))

    @property
    def weight(self) -> float:
        """The push-sum weight w (its smallest, where a share cut off left it uneven)."""
        return min(weight for _, weight in self.segments)

    @classmethod
    def piece_kinds(cls, options: Mapping[str, Any]) -> tuple[str, ...]:
        """Shares are mixed as they arrive."""
        return (*super().piece_kinds(options), *cls.kinds)

    def after_step(self) -> RoundStats:
        self._time_round()
        r = self.round
        row = self._row(r)
        share = 1.0 / (len(row.send_to) + 1)
        # (at least the smallest float: a node cut off for a thousand rounds still pushes a weight)
        self.segments = [(start, max(weight * share, MIN_WEIGHT)) for start, weight in self.segments]
        # One push copy: while the last pushes still leave (a model larger than a round's worth
        # of its links), this round's shares stay here too, as a busy link's do.
        busy = self._push_copy.held and any(self.peer.backlog(t) for t in self._pushed_to)
        targets = self.pace.ready(row.send_to, (lambda _: 1) if busy else self.peer.backlog)
        if targets:
            self._pushed_to = targets
            with self.lock:
                pushed = self._push_copy.pack(self.params)[0]  # it stays untouched while in flight
            starts, weights = zip(*self.segments, strict=True)
            meta = PushShare(list(starts), list(weights)).encode()
            for target in targets:
                self.peer.send(target, PUSH, r, [pushed], meta)
        if kept := len(row.send_to) - len(targets):  # shares held back stay here: no mass is lost
            self.segments = [(start, weight * (1 + kept)) for start, weight in self.segments]
        started = self.peer.now()
        self.pace.sent(r, started)
        expected = self._expected(r - self.overlap)
        arrived = self._take_shares(r, expected)
        wait_s = self.peer.now() - started
        self.round += 1
        self.pace.mixed(self.peer.now())
        return RoundStats(r, len(expected), arrived, wait_s, row.topology)

    def report(self) -> dict[str, float]:
        return {**super().report(), "push_sum_weight": round(self.weight, 6), **self.pace.report()}

    def restart(self, round: int) -> None:
        super().restart(round)
        self.segments = [(0, 1.0)]
        self._coverage = Coverage()
        self._later.clear()
        self._later_bytes = 0

    def _expected(self, r: int) -> set[tuple[str, int]]:
        """The (sender, round) shares this node waits for: round r's in-neighbours' that are
        keeping up (whose newest share is from round r - 1 or later, and not measured to lag)."""
        if r < 0:
            return set()
        members = self.peer.members(r)
        row = mixing_row(self.topology, members, self.peer.node_id, r, self.peer.not_listening())
        self.pace.keep(members)
        slow = self.pace.stragglers(row.receive_from)
        return {(j, r) for j in row.receive_from if self._newest.get(j, r - 1) >= r - 1 and j not in slow}

    def _take_shares(self, r: int, expected: set[tuple[str, int]]) -> int:
        """Mix in what has arrived, waiting (bounded) for the expected shares to be whole; how
        many of those are."""
        mix = RunningMix(
            self.params, self.vector_layout, self.segments, self._scratch, self.lock, self._coverage
        )
        held, self._later, self._later_bytes = self._later, [], 0
        while held:  # (each let go of once mixed: see Averager._receive)
            self._mix_in(held.pop(0), r, mix)
        deadline = self.peer.now() + self.wait_limit()

        def take(received: Envelope) -> None:
            self._mix_in(received, r, mix)

        def coming(sender: str, q: int) -> bool:
            if sender not in self.peer.members(q):
                return False
            key = (sender, q)
            return self.pace.coming(sender, q, complete=mix.complete(key), begun=key in mix.senders)

        while True:
            missing = {(s, q) for s, q in expected if coming(s, q)}
            timeout = 0.0 if not missing else max(0.0, deadline - self.peer.now())
            if not self._receive(timeout, self.kinds, take) and (not missing or self.peer.now() >= deadline):
                break
        for sender, _ in missing:
            self.peer.missed(sender)
        for sender, q in expected:
            if (sender, q) not in mix.senders:
                self.pace.not_in(sender, q)
        self.segments = _merged(mix.weights, self.params.size)
        self._coverage.forget(lambda key: key[1] <= r - self.max_staleness)  # type: ignore[index]
        return sum(mix.complete(key) for key in expected)

    def _mix_in(self, message: Envelope, r: int, mix: RunningMix) -> None:
        """Mix a share, or a piece of one, in; or count why not."""
        key = (message.sender, message.round)
        if message.kind not in self.kinds:
            self.rejected["unexpected_kind"] += 1
            return
        self.pace.arrived(message.sender, message.round, self.peer.now())
        try:
            weights = self._share_weights(message)
        except PayloadError:
            self.rejected["bad_push_weight"] += 1
            self._coverage.refused.add(key)
            return
        size = sum(t.nbytes for t in message.tensors)
        if (
            r < message.round <= r + HOLD_ROUNDS
            and self._later_bytes + size <= HOLD_MODELS * self.params.nbytes
        ):
            self._later.append(message)  # a neighbour a little ahead: its share waits for its round
            self._later_bytes += size
            return
        first = key not in self._coverage.taken and key not in self._coverage.refused
        if first and not self._fresh(message.round, r):
            self._coverage.refused.add(key)
            return
        if self._add(mix, key, message, weights) and first:
            self._accepted(message)
            self._newest[message.sender] = max(self._newest.get(message.sender, -1), message.round)

    def _share_weights(self, message: Envelope) -> Segments:
        """The share's weights by segment, from its header, checked."""
        share = PushShare.decode(message.meta)
        starts, weights = share.starts, share.weights
        if not 1 <= len(starts) == len(weights) <= MAX_SEGMENTS:
            raise PayloadError(f"{len(starts)} segment starts and {len(weights)} weights")
        rising = all(a < b for a, b in itertools.pairwise(starts))
        if starts[0] != 0 or not rising or starts[-1] >= max(self.params.size, 1):
            raise PayloadError("segment starts must rise from 0 within the vector")
        if not all(math.isfinite(w) and 0 < w <= MAX_WEIGHT for w in weights):
            raise PayloadError(f"weights must be in (0, {MAX_WEIGHT:g}]")
        return list(zip(starts, weights, strict=True))


def _merged(segments: Segments, size: int) -> list[tuple[int, float]]:
    """``segments`` with neighbours of (nearly) equal weight joined, each joined run taking its
    elements' mean weight, so the mass is what it was; all joined into one where more than
    ``MAX_SEGMENTS`` would remain (a share must be able to carry them)."""
    runs: list[list[tuple[int, float]]] = []
    for start, weight in segments:
        if runs and abs(weight - runs[-1][0][1]) <= JOIN_TOLERANCE * runs[-1][0][1]:
            runs[-1].append((start, weight))
        else:
            runs.append([(start, weight)])
    if len(runs) > MAX_SEGMENTS:
        runs = [[segment for run in runs for segment in run]]
    bounds = [start for start, _ in segments[1:]] + [size]
    ends = dict(zip([start for start, _ in segments], bounds, strict=True))
    merged = []
    for run in runs:
        if len(run) == 1:
            merged.append(run[0])
            continue
        mass = sum(weight * (ends[start] - start) for start, weight in run)
        merged.append((run[0][0], mass / (ends[run[-1][0]] - run[0][0])))
    return merged
