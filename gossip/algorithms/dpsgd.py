"""Synchronous decentralized averaging: D-PSGD (Lian et al., NeurIPS 2017).

After a local step, node i sends its parameters x_i to the nodes it sends to in round r, waits a
bounded time for the values of the nodes it receives from, and mixes
``x_i <- sum_j W_ij x_j`` over what arrived, with the weights renormalised so they still sum to
one. With every message on time and a doubly-stochastic W the mean of all models is preserved
exactly. The graph may be directed or change every round (``one-peer-exponential``,
``random-matching``): each round's row comes from the topology, and from the membership of that
round (``peer.members(round)``), so a node that left after round R is in the graph up to R.

Stragglers: by default (``stragglers=tolerate``) a round does not wait for a neighbour whose values
have arrived consistently later than the others' (its lag measured against this node's sends,
``gossip.algorithms.pace``): its value is mixed if it is in when the others are, or late, within the
age its lag predicts, its weight divided by (1 + age); and a node whose neighbours run ahead of it
catches up (below, ``catch_up=2``). Nor does it wait for a neighbour that has sent a later round's
value and none of this round's (held back from its busy link: it will not come). Any neighbour's
late value is mixed so, not only a straggler's: where every neighbour is late (this node's downlink,
or its neighbours, slower than its own steps) none is a straggler beside the others, and dropping
their values, which come after each round's wait, left such a node mixing nothing at all. (While a
round waits for a neighbour's value of the round, the rest of that neighbour's late one is not
mixed: a round mixes one value per neighbour, and the one that comes is the newer.) The mean is then
no longer kept exactly, and on a loaded machine a neighbour slowed by the machine's own jitter is
passed over too: with ``stragglers=wait`` a round waits for every neighbour, bounded by the round's
wait limit, and the mean is exact whenever every value comes (a mesh then runs at its slowest node's
pace).
With ``backup=k`` a round proceeds as soon as k of the neighbours it waits for are in (backup
workers); with ``max_staleness=s`` a neighbour whose value for this round is missing is mixed in
with its newest value from the last s rounds, its weight divided by (1 + age) and the rest left
with the node itself (an old value says less about where the mesh is now). With ``catch_up=c`` a
node whose neighbours are c or more rounds ahead of it (a straggler, which backup workers leave
behind) skips to the round after theirs instead of working through the rounds they have left: it
then mixes their newest values and sends in time for their rounds again, rather than mixing values
long gone by (or none: past ``max_rounds_ahead`` they are dropped). The rounds it skips it neither
sends nor mixes; the others mix what they have, so, as with backup workers and stragglers not
waited for, each row still sums to one but the columns no longer do: the mean is no longer kept
exactly (the fast nodes' models weigh more in it). The other way round, a node more than c rounds
ahead of every neighbour whose last round mixed none of their values (its waits gave up on them,
and what came later was too old to mix) waits for them before its next round
(``gossip.algorithms.pace``).

Overlap (``overlap=1``): round r sends x_i as usual but mixes the values of round r - 1, which
were sent a whole round (a step, or H local steps) ago and are usually in by now, so the
communication hides behind the local steps. Mixing old values into a model that has moved
since is done in difference form, keeping the progress made meanwhile:
``x_i <- x_i + γ (sum_j W_ij x_j' - x_i')`` with primes for round r - 1 values. The mean of the
models is kept exactly. With γ = 1 the delayed iteration z² = z - γ(1 - μ) diverges wherever W
has an eigenvalue μ <= 0; with γ = 1/2 it contracts for every μ > -1, at about half of
D-PSGD's rate per round (1 - (1 - μ)/2 against μ).

Periodic exact averaging (``exact_every=P``): every P-th round is on the complete graph of the
round's members, so when every value arrives the models leave it equal to their average
(gossip with periodic global averaging, Chen et al. 2021): the models drift apart between two
such rounds by what P sparse rounds leave, whatever the graph's spectral gap, for n - 1
models sent in one round of P.

Waits come from measured round times (see ``Averager.wait_limit``); a neighbour that misses a
round is not waited for again until it is heard from (``Averager._went_silent``).

Plain rounds (no overlap, no robust rule, no staleness: the default) mix each neighbour's value
as it arrives, piece by piece (``gossip.buffers.pieces``): no message is held whole, mixing
overlaps the arrival of the rest, and a neighbour cut off mid-message counts where its pieces
arrived. The others hold each neighbour's value whole until the round mixes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gossip.algorithms.averager import Averager, AveragerOptions, Needs, RoundStats
from gossip.algorithms.pace import pace_option
from gossip.algorithms.robust import RobustRule
from gossip.buffers.pieces import RunningMix
from gossip.buffers.vector import Frames
from gossip.messages import PARAMS
from gossip.network import Envelope, PeerNetwork
from topologies import MixingRow, Topology

if TYPE_CHECKING:  # (Python 3.11's typing; annotations are not evaluated)
    from typing import Unpack

COMPLETE = Topology("complete")
OVERLAP_GAMMA = 0.5  # the consensus step of the overlapped, one-round-delayed mixing (see above)


class DPSGD(Averager):
    """Args are those of :class:`~gossip.algorithms.averager.Averager`, plus:

    stragglers: "tolerate" (the default): do not wait for a neighbour measured to lag behind the
        others (see above); "wait": wait for every neighbour.
    backup: proceed once this many neighbours' values are in (0: wait for all of them).
    overlap: 1: mix the values of the previous round (see above); 0: of this round.
    max_rounds_ahead: how far ahead of this node a neighbour's message may be and still be kept.
    exact_every: every this many rounds, a round on the complete graph (see above); 0: never.
    catch_up: skip ahead when the neighbours are this many rounds ahead, wait when this many
        rounds ahead of them and alone (see above); 0: never;
        None: ``pace.CATCH_UP`` when tolerating stragglers without overlap on a static graph,
        else never.
    robust: a Byzantine-robust rule that replaces the weighted mean (see ``gossip.algorithms.robust``).
    """

    name: ClassVar[str] = "dpsgd"
    kinds: ClassVar[tuple[str, ...]] = (PARAMS,)
    needs: ClassVar[Needs] = Needs(robust_mixing=True)

    def __init__(
        self,
        peer: PeerNetwork,
        params: np.ndarray,
        *,
        max_staleness: int = 0,
        backup: int = 0,
        overlap: int = 0,
        max_rounds_ahead: int = 64,
        robust: RobustRule | None = None,
        exact_every: int = 0,
        stragglers: str = "tolerate",
        catch_up: int | None = None,
        **common: Unpack[AveragerOptions],
    ) -> None:
        super().__init__(peer, params, max_staleness=max_staleness, **common)
        if overlap not in (0, 1):
            raise ValueError(f"dpsgd overlap is 0 or 1 round, got {overlap}")
        if catch_up and overlap:
            raise ValueError("dpsgd catch_up skips rounds, overlap mixes the one before: choose one")
        self.backup = backup
        self.overlap = overlap
        kinds = self.piece_kinds({"overlap": overlap, "robust": robust, "max_staleness": max_staleness})
        self.streams = PARAMS in kinds
        peer.take_pieces(kinds)
        self._early_pieces: defaultdict[int, list[Envelope]] = defaultdict(list)
        self.exact_every = exact_every
        self._sent: dict[int, np.ndarray] = {}  # own values of rounds whose mixing is to come
        self.robust = robust
        self._max_ahead = max_rounds_ahead
        self._early: defaultdict[int, dict[str, Frames]] = defaultdict(dict)
        self._recent: dict[str, tuple[int, Frames]] = {}  # newest late value of each sender
        # Skipping mixes this round's values, which overlap does not; and on a time-varying graph
        # neighbours' rounds drift apart with no one lagging (each waits only for this round's
        # peers), so hearing one rounds ahead says nothing of being left behind: skipping there
        # would leave the peers that wait for this node's value of a skipped round without it.
        may_skip = not overlap and not self.topology.family.time_varying
        self.pace = pace_option(self.name, stragglers, catch_up, may_skip=may_skip, holds_back=True)
        self._mixing: dict[str, int] = {}  # neighbour -> the round of its value this round mixes
        self._expected: set[str] = set()  # the neighbours whose value of this round is waited for
        self._held_over: list[Envelope] = []  # pieces of the round before the one skipped to
        self._alone = False  # whether the last round mixed none of the neighbours' values
        self.rounds_waited_ahead = 0  # rounds begun by waiting for neighbours it was ahead of

    @classmethod
    def piece_kinds(cls, options: Mapping[str, Any]) -> tuple[str, ...]:
        """Plain rounds (no overlap, no robust rule, no staleness) mix values as they arrive."""
        plain = not (options.get("overlap") or options.get("max_staleness")) and options.get("robust") is None
        return (*super().piece_kinds(options), *(cls.kinds if plain else ()))

    def after_step(self) -> RoundStats:
        return self.average()

    def restart(self, round: int) -> None:
        super().restart(round)
        self._sent.clear()

    def report(self) -> dict[str, float]:
        ahead = {"rounds_waited_ahead": self.rounds_waited_ahead} if self.pace.catch_up else {}
        return {**super().report(), **self.pace.report(), **ahead}

    def average(self) -> RoundStats:
        """One gossip round: send, gather (bounded), mix (this round's values, or with overlap
        the previous round's)."""
        self._time_round()
        if (skip := self.pace.skip_to(self.round, self.peer.members, self.skip_limit)) is not None:
            self._skip_to(skip)
        r = self.round
        sending = self._round_row(r)
        # what is sent must not change while it is in flight: a copy in the buckets' dtypes (of
        # a bfloat16 model, half the bytes of its float32 vector) where the round mixes into the
        # vector as values arrive; a whole copy where the round mixes from it as well
        snapshot = None if self.streams else self.params.copy()
        frames = self._send_frames(self.pace.stragglers) if snapshot is None else self.layout.pack(snapshot)
        self._sent_to = self.pace.ready(sending.send_to, self.peer.backlog, behind=1)
        for target in self._sent_to:
            self.peer.send(target, PARAMS, r, frames)
        self.pace.sent(r, self.peer.now())
        self.round += 1
        if snapshot is None:
            stats = self._mix_as_they_come(r, sending)
        else:
            stats = self._mix_gathered(r, sending, snapshot)
        self.pace.mixed(self.peer.now())
        return stats

    def _mix_gathered(self, r: int, sending: MixingRow, snapshot: np.ndarray) -> RoundStats:
        """Round ``r`` (with overlap: r - 1) mixed once its values are gathered (bounded wait)."""
        mixed = r - self.overlap
        own = self._sent.pop(mixed, None) if self.overlap else snapshot
        if self.overlap:
            self._sent[r] = snapshot
        if own is None:  # the first overlapped round: nothing sent before it to mix
            return RoundStats(mixed, 0, 0, 0.0, sending.topology)
        row = self._round_row(mixed) if self.overlap else sending
        started = self.peer.now()
        values = self._gather(mixed, row)
        wait_s = self.peer.now() - started
        self._alone = bool(row.receive_from) and not values
        with self.lock:
            self._mix(own, row, values)
            if self.overlap:  # x <- x_now + γ (mix(x') - x'), in place
                self.params -= own
                self.params *= OVERLAP_GAMMA
                self.params += snapshot
        return RoundStats(mixed, len(row.receive_from), len(values), wait_s, row.topology)

    def _skip_to(self, r: int) -> None:
        """Go on from round ``r``, dropping what was kept for the rounds skipped but the values
        of round r - 1: a neighbour whose value of r does not come has it mixed late instead
        (its step budget ended after r - 1, and its leave was not heard when the skip was
        decided; see ``Pace.skip_to``)."""
        self.round = r
        self._held_over = self._early_pieces.pop(r - 1, [])
        for sender, frames in self._early.pop(r - 1, {}).items():
            if r - 1 > self._recent.get(sender, (-1, None))[0]:
                self._recent[sender] = (r - 1, frames)
        for early in (self._early, self._early_pieces):
            for old in [k for k in early if k < r]:
                del early[old]

    def _mix_as_they_come(self, r: int, row: MixingRow) -> RoundStats:
        """Round ``r`` mixed piece by piece as the neighbours' values arrive (bounded wait)."""
        mix = RunningMix(self.params, self.layout, row.self_weight, self._scratch, self.lock)
        self._mixing = {}
        neighbours = set(row.receive_from)
        early = self._early_pieces.pop(r, [])
        while early:
            self._take_piece(early.pop(0), r, row, mix)
        started = self.peer.now()
        self._wait_while_ahead(r, neighbours, lambda piece: self._take_piece(piece, r, row, mix))
        waited = self._waited(neighbours)
        self._expected = awaited = waited - self._silent
        enough = min(self.backup, len(waited)) if self.backup else len(waited)
        waiting = {j for j in awaited if self._coming(j, r, mix)}
        deadline = self.peer.now() + self.wait_limit()
        timed_out = False

        def take(arrived: Envelope) -> None:
            nonlocal deadline
            self._take_piece(arrived, r, row, mix)
            if arrived.round == r and arrived.sender in waiting:  # (a value still coming in)
                deadline = max(deadline, self.peer.now() + self.wait_limit())

        # The wait limit is one of silence: a value whose pieces keep arriving (a model that
        # takes longer than the limit to cross its link) is waited for to its end.
        while waiting and sum(mix.complete(j) for j in waited) < enough:
            remaining = deadline - self.peer.now()
            if remaining <= 0:
                timed_out = True
                break
            if self._receive(remaining, self.kinds, take):
                waiting = {j for j in waiting if self._coming(j, r, mix)}
            else:
                waiting &= self.peer.members(r)  # a neighbour that left is not waited for
        self._expected = set()  # (the wait is over: a late value is welcome where none came)
        while self._receive(0, self.kinds, take):  # whatever else is here already
            pass
        held_over, self._held_over = self._held_over, []
        missing = {piece.sender for piece in held_over} - self._mixing.keys()
        while held_over:  # (after a skip: see _skip_to)
            piece = held_over.pop(0)
            if piece.sender in missing:
                self._take_piece(piece, r, row, mix)
        if timed_out:
            self._went_silent(waited - mix.senders)
        for j in awaited - mix.senders:
            self.pace.not_in(j, r)
        wait_s = self.peer.now() - started
        self._alone = bool(neighbours) and not neighbours & mix.senders
        return RoundStats(r, len(neighbours), len(neighbours & mix.senders), wait_s, row.topology)

    def _coming(self, sender: str, r: int, mix: RunningMix) -> bool:
        return self.pace.coming(sender, r, complete=mix.complete(sender), begun=sender in mix.senders)

    def _take_piece(self, message: Envelope, r: int, row: MixingRow, mix: RunningMix) -> None:
        """Mix a neighbour's value (or piece) for round ``r`` in, keep one for a later round,
        or count why not."""
        sender = message.sender
        if message.kind not in self.kinds:
            self.rejected["unexpected_kind"] += 1
            return
        self.pace.arrived(sender, message.round, self.peer.now())
        if message.round > r + self._max_ahead:
            self.dropped["too_far_ahead"] += 1
            return
        age = r - message.round
        if age < 0:  # checked when its round comes
            self._heard_from(sender)
            self._early_pieces[message.round].append(message)
        elif sender not in row.receive_from:
            self.dropped["not_a_neighbour"] += 1
        elif age and (sender in self._expected or not self.pace.mixes_late(sender, age, self.peer.now())):
            self._heard_from(sender)  # too late (or this round's value comes): it is sending again
            self.dropped["stale"] += 1
        elif self._mixing.setdefault(sender, message.round) != message.round:
            self.dropped["stale"] += 1  # (a round mixes one value a neighbour: the first it took)
        else:  # this round's value, or a late one (discounted by its age)
            first = sender not in mix.senders
            if self._add(mix, sender, message, row.receive_from[sender] / (1 + age)):
                self._heard_from(sender)
                if first:
                    self.staleness.add(age)
                    self._accepted(message)

    def _wait_while_ahead(self, r: int, neighbours: set[str], take: Callable[[Envelope], None]) -> None:
        """Before round ``r`` of a node whose last round mixed none of its neighbours' values,
        while it is ahead of every one of them (``Pace.ahead``), hand what comes to ``take``;
        given up once nothing comes for a wait limit (they are silent) or the membership
        changes. A node ahead that mixes their late values (within their age bound, as one
        taking local steps, whose rounds are rarer, does) gains nothing by waiting."""
        if not (self._alone and self.pace.ahead(r, neighbours)):
            return
        self.rounds_waited_ahead += 1
        while self.pace.ahead(r, neighbours) and self._receive(self.wait_limit(), self.kinds, take):
            pass

    def _waited(self, neighbours: set[str]) -> set[str]:
        """The neighbours this round waits for: all but the measured stragglers."""
        return neighbours - self.pace.stragglers(neighbours)

    def _round_row(self, r: int) -> MixingRow:
        """The row of round ``r``: on the complete graph every ``exact_every``-th round."""
        exact = self.exact_every and r % self.exact_every == self.exact_every - 1
        return self._row(r, COMPLETE if exact else None)

    def _gather(self, r: int, row: MixingRow) -> dict[str, tuple[Frames, int]]:
        """Neighbours' values for round r as (frames, age in rounds)."""
        got = self._early.pop(r, {})
        neighbours = set(row.receive_from)
        self._wait_while_ahead(r, neighbours, lambda message: self._file(message, r, got))
        waited = self._waited(neighbours)
        enough = min(self.backup, len(waited)) if self.backup else len(waited)
        awaited = waited - self._silent
        waiting = {j for j in awaited - got.keys() if not self.pace.moved_on(j, r)}
        deadline = self.peer.now() + self.wait_limit()
        timed_out = False
        while waiting and len(waited & got.keys()) < enough:
            remaining = deadline - self.peer.now()
            if remaining <= 0:
                timed_out = True
                break
            message = self.peer.recv(remaining, self.kinds)
            if message is None:
                waiting &= self.peer.members(r)  # a neighbour that left is not waited for
            else:
                self._file(message, r, got)
                waiting = {j for j in waiting - got.keys() if not self.pace.moved_on(j, r)}
        while (message := self.peer.recv(0, self.kinds)) is not None:  # whatever else is here already
            self._file(message, r, got)
        if timed_out:
            self._went_silent(waited - got.keys())
        for j in awaited - got.keys():
            self.pace.not_in(j, r)
        values = {j: (got[j], 0) for j in neighbours if j in got}
        for j in neighbours - got.keys():
            if j in self._recent and self._fresh(self._recent[j][0], r):
                values[j] = (self._recent[j][1], r - self._recent[j][0])
        return values

    def _file(self, message: Envelope, r: int, got: dict[str, Frames]) -> None:
        """Keep a neighbour's value for its round, or as its newest late value, or count why not."""
        if not self._valid(message):
            return
        sender = message.sender
        self._heard_from(sender)
        self.pace.arrived(sender, message.round, self.peer.now())
        if message.round > r + self._max_ahead:
            self.dropped["too_far_ahead"] += 1
            return
        if message.round == r:
            got[sender] = message.tensors
            self.staleness.add(0)
        elif message.round > r:
            self._early[message.round][sender] = message.tensors
        elif r - message.round > self.max_staleness:
            self.dropped["stale"] += 1
            return
        elif message.round > self._recent.get(sender, (-1, None))[0]:
            self._recent[sender] = (message.round, message.tensors)
        self._accepted(message)

    def _mix(self, own: np.ndarray, row: MixingRow, values: dict[str, tuple[Frames, int]]) -> None:
        """Renormalise the row over the values that came, discount old ones, mix (in the
        vector's dtype: narrower frames are widened)."""
        total = row.self_weight + sum(row.receive_from[j] for j in values)
        weights = {j: row.receive_from[j] / total / (1 + age) for j, (_, age) in values.items()}
        if self.robust is not None:
            vectors = {
                j: (self.layout.unpack(frames, own.dtype), weights[j]) for j, (frames, _) in values.items()
            }
            self.robust.mix(own, vectors, self.params)
            return
        np.multiply(own, 1.0 - sum(weights.values()), out=self.params)
        for sender, (frames, _) in values.items():
            self.layout.add_scaled(self.params, frames, weights[sender], self._scratch)
