"""CHOCO-SGD (Koloskova, Stich & Jaggi, ICML 2019; Koloskova et al., ICLR 2020): decentralized
SGD that sends compressed differences instead of models.

Every node i keeps a public copy x̂_i of its model, and each of its neighbours holds a replica
of it. After local steps node i sends q_i = Q(x_i - x̂_i), the compressed difference; every
holder (node i included) adds the decoded q_i to its copy of x̂_i, and node i moves towards its
neighbours' public copies with the consensus step size γ:

    x_i <- x_i + γ Σ_j w_ij (x̂_j - x̂_i)

What Q drops stays in x_i - x̂_i and goes out in later rounds: the replica difference is the
error feedback that lets biased compressors (top-k, int8) converge. With an exact codec and
γ = 1 this is D-PSGD's mixing step.

A replica must take in every q of its sender, in order. Each q carries its round. A holder with
no replica yet (first contact, a new neighbour after a membership change) or that sees a gap
(a lost message, a sender that restarted) asks the sender for its public copy and applies the
q's that follow it. Round r mixes every public copy at its round-r version, its own included:
then the pair terms w_ij (x̂_j - x̂_i) and w_ji (x̂_i - x̂_j) cancel and the mean of the models is
kept exactly. A q that comes ahead of its round waits for it; one that comes after its round was
mixed is still added (updates add up, nothing goes stale), and that neighbour is left out of
the rounds it was late for, as D-PSGD leaves out a late value. The difference form needs no
renormalisation: the node just does not move towards it.

Every holder must receive every q of its sender, so CHOCO runs on static undirected graphs.

What arrives is checked where it is used: a q must decode to finite values (the codecs refuse
anything else), a full copy must be finite, and a replica that the q's of a diverged neighbour
have made non-finite is dropped and asked for afresh (``rejected["non_finite"]``) rather than
mixed in. A full copy is sent only to a member, and to each at most twice per round timeout,
however often it asks.

The parameters may live on a CUDA device (a cupy view of the model's flat buffer,
``gossip.arrays.from_torch``): then the public copies, the replicas, the differences, the codec
and the mixing all run as kernels there, and only the encoded frames cross to the host (staged
in pinned memory, ``gossip.arrays.to_host``) and back (``to_device``).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from gossip.arrays import Array, array_module, to_device, to_host
from gossip.averager import Averager, Needs, RoundStats
from gossip.compression import Codec, CodecError, Sparse
from gossip.network import Envelope, PeerNetwork
from gossip.vector import Layout, add_scaled, all_finite
from topologies import MixingRow, Topology

KIND = "choco"
FULL_REQUEST = "choco_full_request"
FULL = "choco_full"
MAX_PENDING = 64  # q's kept for a replica waiting for its full copy; beyond that, ask again


def default_gamma(codec: Codec) -> float:
    """The consensus step size: 1 for the dense codecs; for sparse ones about twice the kept
    fraction for top-k and the fraction itself for random-k. Too large a γ diverges (CHOCO's
    theory asks for γ of the order of the compression quality δ; Koloskova et al. tune it per
    codec). Measured on pure averaging of 500-element vectors over a ring of 8: top-10%
    converges up to γ = 0.3 and diverges at 0.4; random-10% diverges at 0.2; top-1% is fastest
    near 0.02."""
    if isinstance(codec, Sparse):
        return min(1.0, (2 if codec.name == "topk" else 1) * codec.fraction)
    return 1.0


@dataclass
class _Replica:
    """A neighbour's public copy as this node holds it, at the version of one round."""

    value: Array | None = None  # None until the sender's full copy arrives (on this node's device)
    next_round: int = 0  # the round of the next q to add (the value is that of the round before)
    pending: dict[int, Array] = field(default_factory=dict)  # q's not added yet
    asked_at: float = -math.inf  # when the full copy was last requested (peer.now() s)

    def catch_up(self, upto: int) -> bool:
        """Add the pending q's of rounds up to ``upto`` that follow on without a gap; False when
        that made the value non-finite (then it is dropped: the full copy is asked again)."""
        if self.value is None:
            return True
        start = self.next_round
        with np.errstate(over="ignore"):  # an overflow is what the check below catches
            while self.next_round <= upto and (q := self.pending.pop(self.next_round, None)) is not None:
                self.value += q
                self.next_round += 1
        if self.next_round == start or _finite(self.value):
            return True
        self.value = None
        return False

    @property
    def has_gap(self) -> bool:
        """A q is missing before the ones pending (they come in order from one sender)."""
        return bool(self.pending) and min(self.pending) != self.next_round

    def usable_at(self, round: int) -> bool:
        return self.value is not None and self.next_round == round + 1


class CHOCO(Averager):
    """Args are those of :class:`~gossip.averager.Averager`, plus:

    codec: the compressor Q (``gossip.compression.Codec.parse``).
    gamma: the consensus step size γ in (0, 1]; None: :func:`default_gamma`.
    """

    name: ClassVar[str] = "choco"
    kinds: ClassVar[tuple[str, ...]] = (KIND, FULL_REQUEST, FULL)
    # every holder of a replica must see every update of it
    needs: ClassVar[Needs] = Needs(static_undirected_graph=True, compression=True)

    def __init__(
        self,
        peer: PeerNetwork,
        params: Array,
        *,
        topology: Topology,
        codec: Codec,
        round_timeout: float = 2.0,
        lock: AbstractContextManager[object] | None = None,
        layout: Layout | None = None,
        gamma: float | None = None,
    ) -> None:
        if params.dtype != np.float32:
            raise ValueError(f"CHOCO's codecs work on float32 parameters, not {params.dtype}")
        super().__init__(
            peer, params, topology=topology, round_timeout=round_timeout, lock=lock, layout=layout
        )
        self.codec = codec
        self.gamma = default_gamma(codec) if gamma is None else gamma
        if not 0 < self.gamma <= 1:
            raise ValueError(f"CHOCO: gamma must be in (0, 1], got {self.gamma}")
        self.public = params.copy()  # x̂_i
        self._published = -1  # the last round whose q is in self.public
        self._replicas: dict[str, _Replica] = {}
        self._full_copy_sent_at: dict[str, float] = {}  # requester -> when (peer.now() s)
        self.full_copies_sent = 0

    def after_step(self) -> RoundStats:
        self._time_round()
        r = self.round
        codec = self.codec.for_round(r)
        encoded = codec.encode(self.params - self.public)
        row = self._row(r)
        try:
            self.public += codec.decode(encoded.frames, encoded.meta, self.public.size)
        except CodecError as exc:  # this node's own model diverged: nothing it could send is sane
            self.dropped[f"own_update_{exc.reason}"] += 1
        else:
            self._published = r
            frames = to_host(encoded.frames)
            meta = {**encoded.meta, "codec": str(codec)}
            for target in row.send_to:
                self.peer.send(target, KIND, r, frames, meta)
        started = self.peer.now()
        expected = self._gather(r, row)
        wait_s = self.peer.now() - started
        with self.lock:
            mixed = self._mix(r, row)
        self.round += 1
        return RoundStats(r, len(expected), len(expected & mixed), wait_s, row.topology)

    def restart(self, round: int) -> None:
        super().restart(round)
        self.public[...] = self.params
        self._published = round - 1
        self._replicas.clear()

    def report(self) -> dict[str, float]:
        return {**super().report(), "full_copies_sent": self.full_copies_sent}

    # -- replicas -----------------------------------------------------------------------------

    def _gather(self, r: int, row: MixingRow) -> set[str]:
        """Take in messages until every neighbour's replica is at round r (bounded wait);
        returns the neighbours waited for."""
        members = self.peer.members(r)
        for gone in self._replicas.keys() - self.peer.members():
            del self._replicas[gone]
        for j in row.receive_from:
            replica = self._replicas.setdefault(j, _Replica())
            self._catch_up(replica, r)
            if replica.value is None:
                self._ask_full_copy(j, replica)
        expected = set(row.receive_from) - self._silent
        deadline = self.peer.now() + self.wait_limit()
        while True:
            waiting = {j for j in expected & members if self._replicas[j].next_round <= r}
            timeout = max(0.0, deadline - self.peer.now()) if waiting else 0.0
            message = self.peer.recv(timeout, self.kinds)
            if message is not None:
                self._take(message)
            elif not waiting or self.peer.now() >= deadline:
                break
        self._went_silent(waiting)
        return expected

    def _take(self, message: Envelope) -> None:
        sender = message.sender
        if message.kind == FULL_REQUEST:
            self._send_full_copy(sender)
            return
        if message.kind == FULL:
            if self._valid(message, self.vector_layout):
                self._heard_from(sender)
                replica = self._replicas.setdefault(sender, _Replica())
                replica.value = array_module(self.params).array(message.tensors[0], dtype=self.params.dtype)
                replica.next_round = message.round + 1
                replica.pending = {k: q for k, q in replica.pending.items() if k > message.round}
                self._catch_up(replica, self.round)
            return
        try:
            codec = self.codec.for_message(message.meta)
            q = codec.decode(to_device(message.tensors, self.params), message.meta, self.params.size)
        except CodecError as exc:
            self.rejected[exc.reason] += 1
            return
        self._heard_from(sender)
        self.staleness.add(max(0, self.round - message.round))  # late q's still count in full
        replica = self._replicas.setdefault(sender, _Replica())
        if message.round < replica.next_round:
            return  # already in the full copy this replica started from
        replica.pending[message.round] = q
        self._catch_up(replica, self.round)
        if replica.value is None or replica.has_gap:
            if len(replica.pending) > MAX_PENDING:
                replica.pending.clear()
            self._ask_full_copy(sender, replica)

    def _catch_up(self, replica: _Replica, upto: int) -> None:
        if not replica.catch_up(upto):
            self.rejected["non_finite"] += 1

    def _send_full_copy(self, to: str) -> None:
        """Answer a request for our public copy: a member's, at most once per half round
        timeout (it asks at most once per round timeout)."""
        now = self.peer.now()
        members = self.peer.members()
        for gone in self._full_copy_sent_at.keys() - members:
            del self._full_copy_sent_at[gone]
        if (
            self._published < 0  # nothing published yet (and round -1 does not go on the wire): it asks again
            or to not in members
            or now - self._full_copy_sent_at.get(to, -math.inf) < self.round_timeout / 2
        ):
            self.dropped["full_copy_request"] += 1
            return
        self._full_copy_sent_at[to] = now
        self.peer.send(to, FULL, self._published, to_host([self.public.copy()]))
        self.full_copies_sent += 1

    def _ask_full_copy(self, node: str, replica: _Replica) -> None:
        """Request ``node``'s public copy, at most once per round timeout."""
        now = self.peer.now()
        if now - replica.asked_at >= self.round_timeout:
            replica.asked_at = now
            self.peer.send(node, FULL_REQUEST, self.round)

    def _mix(self, r: int, row: MixingRow) -> set[str]:
        """x_i += γ Σ_j w_ij (x̂_j - x̂_i) over the neighbours whose replica is at round r."""
        usable = [j for j in row.receive_from if j in self._replicas and self._replicas[j].usable_at(r)]
        total = 0.0
        for j in usable:
            value = self._replicas[j].value
            assert value is not None
            add_scaled(self.params, value, self.gamma * row.receive_from[j], self._scratch)
            total += row.receive_from[j]
        add_scaled(self.params, self.public, -self.gamma * total, self._scratch)
        return set(usable)


def _finite(value: Array) -> bool:
    return (
        all_finite(value)
        if isinstance(value, np.ndarray)
        else bool(array_module(value).isfinite(value).all())
    )
