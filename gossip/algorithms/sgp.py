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

``overlap`` is how many rounds a share may take to arrive: with 0 a node waits (bounded) for
this round's shares, with 1 (the default, the paper's 1-overlap SGP) it sends this round's
shares and waits only for those of the previous round, which have had a whole local step to
arrive, so communication hides behind computation. An in-neighbour that has fallen behind (its
newest share is older than that) is not waited for: waiting cannot make it faster, and push-sum
does not need shares to come in step. Nor is one whose shares arrive consistently later than the
others' (``gossip.algorithms.pace``): waited for, a slow node never falls behind, and the whole
mesh would run at its pace. A share from one of the next ``HOLD_ROUNDS`` rounds waits
for its round (so nodes in step mix exactly as the graph says); any other is mixed in as soon as
it is read (a node that has fallen far behind takes in the mass the others push to it at once).
A share older than ``max_staleness`` rounds is dropped and counted. The default bound is
generous (256 rounds) because a dropped share takes its mass with it: push-sum is exact only
while mass is conserved, and a node that keeps losing mass drives its weight towards zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np

from gossip.algorithms.averager import Averager, AveragerOptions, RoundStats
from gossip.algorithms.pace import Pace
from gossip.buffers.vector import add_scaled
from gossip.messages import PUSH
from gossip.network import Envelope, PeerNetwork
from topologies import mixing_row

if TYPE_CHECKING:  # (Python 3.11's typing; annotations are not evaluated)
    from typing import Unpack

HOLD_ROUNDS = 8
MIN_WEIGHT = float(np.finfo(np.float64).tiny)


class SGP(Averager):
    """Args are those of :class:`~gossip.algorithms.averager.Averager`, plus ``overlap`` (see above)."""

    name: ClassVar[str] = "sgp"
    kinds: ClassVar[tuple[str, ...]] = (PUSH,)

    def __init__(
        self,
        peer: PeerNetwork,
        params: np.ndarray,
        *,
        max_staleness: int = 256,
        overlap: int = 1,
        **common: Unpack[AveragerOptions],
    ) -> None:
        super().__init__(peer, params, max_staleness=max_staleness, **common)
        self.overlap = overlap
        self.weight = 1.0  # w (z is ``params``)
        self._arrived: set[tuple[str, int]] = set()  # (sender, round) of the shares mixed in
        self._newest: dict[str, int] = {}  # sender -> round of its newest share
        self._later: list[Envelope] = []  # shares for rounds this node has not reached
        self.pace = Pace(tolerate=True, catch_up=0)

    def after_step(self) -> RoundStats:
        self._time_round()
        r = self.round
        row = self._row(r)
        share = 1.0 / (len(row.send_to) + 1)
        # (at least the smallest float: a node cut off for a thousand rounds still pushes a weight)
        self.weight = max(self.weight * share, MIN_WEIGHT)
        if row.send_to:
            with self.lock:
                pushed = self.params.copy()  # it stays untouched while in flight
            weight = np.array([self.weight])
            for target in row.send_to:
                self.peer.send(target, PUSH, r, [pushed, weight])
        started = self.peer.now()
        self.pace.sent(r, started)
        expected = self._expected(r - self.overlap)
        self._take_shares(r, expected)
        wait_s = self.peer.now() - started
        self.round += 1
        self.pace.mixed(self.peer.now())
        return RoundStats(r, len(expected), len(expected & self._arrived), wait_s, row.topology)

    def report(self) -> dict[str, float]:
        return {**super().report(), "push_sum_weight": round(self.weight, 6), **self.pace.report()}

    def restart(self, round: int) -> None:
        super().restart(round)
        self.weight = 1.0
        self._arrived.clear()
        self._later.clear()

    def _expected(self, r: int) -> set[tuple[str, int]]:
        """The (sender, round) shares this node waits for: round r's in-neighbours' that are
        keeping up (whose newest share is from round r - 1 or later, and not measured to lag)."""
        if r < 0:
            return set()
        row = mixing_row(self.topology, self.peer.members(r), self.peer.node_id, r, self.peer.not_listening())
        slow = self.pace.stragglers(row.receive_from)
        return {(j, r) for j in row.receive_from if self._newest.get(j, r - 1) >= r - 1 and j not in slow}

    def _take_shares(self, r: int, expected: set[tuple[str, int]]) -> None:
        """Mix in the shares that have arrived, waiting (bounded) for the expected ones."""
        for held in [m for m in self._later if m.round <= r]:
            self._later.remove(held)
            self._mix_in(held, r)
        deadline = self.peer.now() + self.wait_limit()
        while True:
            missing = {(s, q) for s, q in expected - self._arrived if s in self.peer.members(q)}
            timeout = 0.0 if not missing else max(0.0, deadline - self.peer.now())
            received = self.peer.recv(timeout, self.kinds)
            if received is None:
                if not missing or self.peer.now() >= deadline:
                    break
                continue
            self._mix_in(received, r)
        for sender, _ in missing:
            self.peer.missed(sender)
        self._arrived = {(s, q) for s, q in self._arrived if q > r - self.max_staleness}

    def _mix_in(self, message: Envelope, r: int) -> None:
        if not self._valid(message, self.vector_layout, extra=1):
            return
        self.pace.arrived(message.sender, message.round, self.peer.now())
        if r < message.round <= r + HOLD_ROUNDS:  # a neighbour a little ahead: keep it for its round
            self._later.append(message)
            return
        weight = message.tensors[1]
        if weight.dtype != np.float64 or weight.shape != (1,) or not 0 < float(weight[0]) <= 1e6:
            self.rejected["bad_push_weight"] += 1
            return
        if not self._fresh(message.round, r):
            return
        total = self.weight + float(weight[0])
        with self.lock:  # z += (w_j / (w + w_j)) (z_j - z)
            self.params *= self.weight / total
            add_scaled(self.params, message.tensors[0], float(weight[0]) / total, self._scratch)
        self.weight = total
        self._accepted(message)
        self._arrived.add((message.sender, message.round))
        self._newest[message.sender] = max(self._newest.get(message.sender, -1), message.round)
