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

A replica must take in every q of its sender, in order. Each q carries its round. Every
public copy is 0 before round 0 (the paper's x̂⁰ = 0): the first q carries the whole model,
compressed, and a holder starts its replica from a neighbour's round-0 q with no copy sent.
A holder that first hears of a neighbour at a later round (a new neighbour after a membership
change, a restart) or that sees a gap (a lost message) asks the sender for its public copy and
applies the q's that follow it. Round r mixes every public copy at its round-r version, its own included:
then the pair terms w_ij (x̂_j - x̂_i) and w_ji (x̂_i - x̂_j) cancel and the mean of the models is
kept exactly. A q that comes ahead of its round waits for it; one that comes after its round was
mixed is still added (updates add up, nothing goes stale), and that neighbour is left out of
the rounds it was late for, as D-PSGD leaves out a late value. The difference form needs no
renormalisation: the node just does not move towards it.

Every holder must receive every q of its sender, so CHOCO runs on static undirected graphs.

Where every pair mixes at γ = 1 (a dense codec, γ left to its default: the paper's
memory-efficient form), a node holds its neighbours' public copies as one sum
s_i = Σ_j w_ij x̂_j, each q added into it by its weight, and mixes x_i += s_i - Σ_j w_ij x̂_i:
two vectors (x̂_i and s_i) whatever the degree, where a replica each holds 1 + degree (beside
them: a window of each stream, and after a restart the q's kept whole until the full copies
come). What the
sum cannot do is take one neighbour out: it starts again from every neighbour's public copy when
one leaves the row or changes its weight, when one's q's show a gap, and when it turns
non-finite (``sum_restarts``); and it mixes a late neighbour at the version it has reached,
the whole step divided by (1 + age) of the oldest (with a node 4x slower, bench/stragglers.py
reached 0.95 in 14.7-17.9 s against 15.4 with a replica each, and 17.7-19.7 undivided). A
sparse codec's γ adapts per node, and a γ set by hand may differ between nodes: then each pair
mixes at its own γ, which needs a replica of each neighbour.

Stragglers (``stragglers=tolerate``, the default; ``wait`` waits for every neighbour) as in D-PSGD
(``gossip.algorithms.pace``): a round does not wait for a neighbour whose q's arrive consistently
later than the others'; its replica is mixed at the version it has reached, within the age its lag
predicts, the pair weight divided by (1 + age). A node whose neighbours are ``catch_up`` (2) or
more rounds ahead skips to the round after theirs and sends its public copy as of the round before
it (``CHOCO_FULL``), so its holders' replicas go on from there without asking. Mixing a replica of
another round breaks the pair terms' cancellation: the mean of the models is then no longer kept
exactly.

What arrives is checked where it is used: a q must decode to finite values (the codecs refuse
anything else), a full copy must be finite, and a replica that the q's of a diverged neighbour
have made non-finite is dropped and asked for afresh (``rejected["non_finite"]``) rather than
mixed in. A full copy is sent only to a member, and to each at most twice per round timeout,
however often it asks.

The parameters may live on a CUDA device (a cupy view of the model's flat buffer,
``gossip.buffers.arrays.from_torch``): then the public copies, the replicas, the differences, the codec
and the mixing all run as kernels there, and only the encoded frames cross to the host (staged
in pinned memory, ``gossip.buffers.arrays.to_host``) and back (``to_device``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gossip.algorithms.averager import Averager, AveragerOptions, Needs, RoundStats
from gossip.algorithms.choco_replicas import (
    MAX_PENDING,
    STREAM_IDLE_ROUND_TIMEOUTS,
    Assembly,
    Replica,
    Streaming,
    Update,
    owned,
)
from gossip.algorithms.choco_step import StepSize, read_step
from gossip.algorithms.pace import pace_option
from gossip.buffers.arrays import Array, array_module, to_device, to_host
from gossip.buffers.vector import add_scaled, all_finite, squared_distance
from gossip.compression import Codec, CodecError, Encoded, Sparse, StreamedDecode
from gossip.messages import CHOCO_FULL, CHOCO_FULL_REQUEST, CHOCO_UPDATE, ChocoStep
from gossip.network import Envelope, PeerNetwork
from topologies import MixingRow

if TYPE_CHECKING:  # (Python 3.11's typing; annotations are not evaluated)
    from typing import Unpack


class CHOCO(Averager):
    """Args are those of :class:`~gossip.algorithms.averager.Averager`, plus:

    codec: the compressor Q (``gossip.compression.Codec.parse``).
    gamma: the consensus step size γ in (0, 1]; None: 1 for a dense codec, adaptive for a
        sparse one (:class:`StepSize`).
    stragglers: "tolerate" (the default): do not wait for a neighbour measured to lag behind the
        others; "wait": wait for every neighbour.
    catch_up: skip ahead when the neighbours are this many rounds ahead; 0: never; None:
        ``pace.CATCH_UP`` when tolerating stragglers.
    """

    name: ClassVar[str] = "choco"
    kinds: ClassVar[tuple[str, ...]] = (CHOCO_UPDATE, CHOCO_FULL_REQUEST, CHOCO_FULL)
    # every holder of a replica must see every update of it
    needs: ClassVar[Needs] = Needs(static_undirected_graph=True, compression=True)

    def __init__(
        self,
        peer: PeerNetwork,
        params: Array,
        *,
        codec: Codec,
        gamma: float | None = None,
        stragglers: str = "tolerate",
        catch_up: int | None = None,
        **common: Unpack[AveragerOptions],
    ) -> None:
        if params.dtype != np.float32:
            raise ValueError(f"CHOCO's codecs work on float32 parameters, not {params.dtype}")
        super().__init__(peer, params, **common)
        self.codec = codec
        self.step_size = StepSize(gamma)
        self.public = array_module(params).zeros_like(params)  # x̂_i
        self._published = -1  # the last round whose q is in self.public
        self._published_gamma = self.step_size.value  # this node's γ at that round
        self._replicas: dict[str, Replica] = {}
        # Σ_j w_ij x̂_j where every pair mixes at γ = 1 (a dense codec, γ left to its default):
        # one vector whatever the degree, instead of a replica per neighbour
        summed = gamma is None and codec.dense
        self._sum = array_module(params).zeros_like(params) if summed else None
        self._weights: Mapping[str, float] = {}  # the row the sum is weighed by
        self.sum_restarts = 0
        # q's taken piece by piece (the sum's): each neighbour's being added, or put together
        # whole, and pieces that wait for their turn (a window of each stream: credit bounds
        # it; a stream whose pieces stop is dropped, _drop_stalled_streams)
        peer.take_pieces(self.piece_kinds({"codec": codec, "gamma": gamma}))
        self._streaming: dict[str, Streaming] = {}
        self._assembling: dict[str, Assembly] = {}
        self._held: list[tuple[Envelope, float]] = []
        self._full_copy_sent_at: dict[str, float] = {}  # requester -> when (peer.now() s)
        self.full_copies_sent = 0
        self.pace = pace_option(self.name, stragglers, catch_up)

    @classmethod
    def piece_kinds(cls, options: Mapping[str, Any]) -> tuple[str, ...]:
        """The q's of a dense codec at the default γ are added to the sum as they arrive."""
        codec = options.get("codec")
        summed = codec is not None and codec.dense and options.get("gamma") is None
        return (*super().piece_kinds(options), *((CHOCO_UPDATE,) if summed else ()))

    def after_step(self) -> RoundStats:
        self._time_round()
        if (skip := self.pace.skip_to(self.round, self.peer.members, self.skip_limit)) is not None:
            self._skip_to(skip)
        r = self.round
        codec = self.codec.for_round(r)
        row = self._row(r)
        try:
            encoded = self._publish(codec)
        except CodecError as exc:  # this node's own model diverged: nothing it could send is sane
            self.dropped[f"own_update_{exc.reason}"] += 1
        else:
            self._published = r
            frames = to_host(encoded.frames)
            meta = {**encoded.meta, "codec": str(codec), **ChocoStep(self._published_gamma).encode()}
            for target in row.send_to:
                self.peer.send(target, CHOCO_UPDATE, r, frames, meta)
        started = self.peer.now()
        self.pace.sent(r, started)
        expected = self._gather(r, row)
        wait_s = self.peer.now() - started
        with self.lock:
            mixed = self._mix(r, row)
        self.round += 1
        self.pace.mixed(self.peer.now())
        return RoundStats(r, len(expected), len(expected & mixed), wait_s, row.topology)

    def _publish(self, codec: Codec) -> Encoded:
        """Encode q = Q(x - x̂), add it to the public copy x̂ and set this node's γ; raises
        :class:`CodecError` (x̂ left as it was) when q is not finite. Chunk by chunk for the
        dense codecs: no difference vector, no decoded one."""
        size = self.public.size
        owed = squared_distance(self.params, self.public) if self.step_size.measures(codec) else 0.0
        encoded = codec.encode(self.params, minus=self.public)
        codec.check(encoded.frames, encoded.meta, size)
        codec.add_decoded(self.public, encoded.frames, encoded.meta)
        carried = 0.0
        if owed and isinstance(codec, Sparse):
            _, values = codec.entries(encoded.frames, encoded.meta, size)
            carried = float(array_module(values).vdot(values, values))
        self._published_gamma = self.step_size.update(codec, owed, carried)
        return encoded

    def _skip_to(self, r: int) -> None:
        """Go on from round ``r``: the public copy, unchanged by the rounds skipped, goes to the
        holders of its replicas as that of round r - 1, so the q of round r follows on."""
        self.round = r
        copy, meta = self._full_copy()
        self._published = r - 1
        for target in self._row(r).send_to:
            self.peer.send(target, CHOCO_FULL, self._published, copy, meta)
            self.full_copies_sent += 1

    def _full_copy(self) -> tuple[list[Array], dict[str, Any]]:
        """This node's public copy to send, and its meta: γ, and the round of its last q."""
        meta = ChocoStep(self._published_gamma, since=self._published).encode()
        return to_host([self.public.copy()]), meta

    def restart(self, round: int) -> None:
        super().restart(round)
        self.public[...] = self.params if round > 0 else 0  # (0 before round 0, as at the start)
        self._published = round - 1
        self._replicas.clear()
        self._assembling.clear()
        if self._sum is not None:
            self._restart_sum(counted=False)

    def report(self) -> dict[str, float]:
        figures = {
            "full_copies_sent": self.full_copies_sent,
            "gamma": self.step_size.value,
            "sum_restarts": self.sum_restarts,
        }
        return {**super().report(), **figures, **self.pace.report()}

    # -- replicas -----------------------------------------------------------------------------

    def _gather(self, r: int, row: MixingRow) -> set[str]:
        """Take in messages until every neighbour's replica is at round r (bounded wait);
        returns the neighbours waited for."""
        members = self.peer.members(r)
        if self._sum is not None:
            self._weigh_sum(row.receive_from)  # (a neighbour that left the row restarts the sum)
            self._drop_stalled_streams()
        # a member that left after round r still mixes in it; one that died since the row was
        # made stays in it for this round (its share of the sum goes out with the next row's)
        for gone in self._replicas.keys() - members - row.receive_from.keys():
            del self._replicas[gone]
            self._assembling.pop(gone, None)
        self._release_held()
        for j in row.receive_from:  # (a replica with no start asks once j's q's show it: _take)
            self._catch_up(j, self._replicas.setdefault(j, Replica()), r)
        expected = set(row.receive_from) - self._silent - self.pace.stragglers(row.receive_from)
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
        if message.kind == CHOCO_FULL_REQUEST:
            self._send_full_copy(sender)
            return
        step = read_step(message.meta)
        if step is None:
            self.rejected["choco_gamma"] += 1
            return
        gamma = step.gamma
        if message.kind == CHOCO_FULL:
            if self._valid(message, self.vector_layout):
                self._heard_from(sender)
                replica = self._replicas.setdefault(sender, Replica())
                if replica.value is not None and message.round < replica.next_round:
                    self.dropped["choco_stale_copy"] += 1  # (a second answer, or one overtaken)
                    return
                if not self._start(sender, replica, message.tensors[0], step.since):
                    return
                replica.next_round, replica.gamma = message.round + 1, gamma
                replica.pending = {k: q for k, q in replica.pending.items() if k > message.round}
                self._catch_up(sender, replica, self.round)
                self._accepted(message)
            return
        if message.piece is not None:
            if message.piece.offset == 0:
                self._arrived(message)
            self._route_piece(message, gamma)
            self._release_held()  # (what it began, continued or ended may let held pieces on)
            return
        self._arrived(message)
        self._keep_whole(message, message.tensors, gamma)

    def _arrived(self, message: Envelope) -> None:
        """A neighbour's q began to arrive."""
        self._heard_from(message.sender)
        self.pace.arrived(message.sender, message.round, self.peer.now())
        self.staleness.add(max(0, self.round - message.round))  # late q's still count in full

    def _keep_whole(self, message: Envelope, frames: Sequence[Array], gamma: float) -> None:
        """Check a neighbour's whole q (``frames``, as it came or put together) and keep it."""
        try:
            codec = self.codec.for_message(message.meta)
            checked = to_device(frames, self.params)
            codec.check(checked, message.meta, self.params.size)
        except CodecError as exc:
            self.rejected[exc.reason] += 1
            return
        self._keep(message, Update(codec, checked, message.meta, gamma))

    def _keep(self, message: Envelope, update: Update) -> None:
        """Keep a neighbour's checked q, whole, until its replica takes it in."""
        sender = message.sender
        if (replica := self._replica_for(sender, message.round)) is None:
            return
        replica.pending[message.round] = update
        self._accepted(message)
        self._catch_up(sender, replica, self.round)
        if replica.value is None or replica.has_gap:
            if len(replica.pending) > MAX_PENDING:
                replica.pending.clear()
            if self._sum is None or sender in self._weights:  # (the sum keeps neighbours only)
                self._ask_full_copy(sender, replica)

    def _replica_for(self, sender: str, round: int) -> Replica | None:
        """``sender``'s replica, where its q of ``round`` is still to go in: None where the full
        copy it started from holds that q, or the q is too far ahead (counted)."""
        replica = self._replicas.setdefault(sender, Replica())
        if round < replica.next_round:
            return None
        if round > self.round + MAX_PENDING:
            self.dropped["choco_ahead"] += 1  # it would wait for rounds this node is far from
            return None
        return replica

    def _catch_up(self, sender: str, replica: Replica, upto: int) -> None:
        if replica.value is None and replica.next_round == 0 and 0 in replica.pending:
            self._start_at_zero(sender, replica)  # (x̂⁰ = 0)
        if not replica.catch_up(upto):
            self.rejected["non_finite"] += 1
            if self._sum is not None:  # (a q of which neighbour made it so, the sum cannot tell)
                self._restart_sum()

    # -- q's piece by piece --------------------------------------------------------------------

    def _route_piece(self, message: Envelope, gamma: float) -> None:
        """A piece of a neighbour's q: added to the sum in order as it comes where the q is
        its started replica's next and of a round this node has reached; held where it follows
        a q still coming, is of a round ahead, or comes before pieces it follows (a q spread
        over several connections, ``--streams``, comes in any order); else put together whole
        and kept (a replica that waits for its full copy, a gap)."""
        sender, round = message.sender, message.round
        assert message.piece is not None
        if (streaming := self._streaming.get(sender)) is not None and streaming.round == round:
            self._stream(message, streaming)
            return
        if (assembly := self._assembling.get(sender)) is not None and assembly.round == round:
            self._assemble(message, assembly)
            return
        if (replica := self._replica_for(sender, round)) is None:
            return
        if message.piece.offset:  # (ahead of its q's first piece, over another connection)
            self._hold(message, gamma)
            return
        if replica.value is None and replica.next_round == round == 0:
            self._start_at_zero(sender, replica)  # (x̂⁰ = 0)
        if self._sum is not None and replica.value is not None:
            if round > self.round or sender in self._streaming:
                self._hold(message, gamma)
                return
            if round == replica.next_round:
                try:
                    codec = self.codec.for_message(message.meta)
                    decode = StreamedDecode(codec, message.piece.specs, self._sum, replica.weight)
                except CodecError as exc:
                    self.rejected[exc.reason] += 1
                    return
                self._streaming[sender] = streaming = Streaming(round, decode, gamma, self.peer.now())
                self._stream(message, streaming)
                return
        total = sum(nbytes for _, _, nbytes in message.piece.specs)
        self._assembling[sender] = assembly = Assembly(
            round, gamma, message.piece.specs, np.empty(total, np.uint8)
        )
        self._assemble(message, assembly)

    def _stream(self, message: Envelope, streaming: Streaming) -> None:
        sender = message.sender
        assert message.piece is not None
        offset = message.piece.offset
        if offset != streaming.decode.received:  # (ahead of its turn, over another connection)
            self._hold(message, streaming.gamma)
            return
        streaming.heard = self.peer.now()
        try:
            for part in message.tensors:
                streaming.decode.feed(part, offset)
                offset += part.nbytes
        except CodecError as exc:
            self.rejected[exc.reason] += 1
            self._restart_sum()  # (what came of it is in the sum)
            return
        if streaming.decode.complete:
            del self._streaming[sender]
            replica = self._replicas[sender]
            replica.next_round, replica.gamma = streaming.round + 1, streaming.gamma
            self._accepted(message)
            self._catch_up(sender, replica, self.round)

    def _assemble(self, message: Envelope, assembly: Assembly) -> None:
        sender = message.sender
        assert message.piece is not None
        offset = message.piece.offset
        for part in message.tensors:  # (in any order: the transport checked they tile the q)
            if offset + part.size > assembly.payload.size or part.dtype != np.uint8:
                self.rejected["piece_order"] += 1
                del self._assembling[sender]
                return
            assembly.payload[offset : offset + part.size] = part
            offset += part.size
            assembly.received += part.size
        if assembly.received < assembly.payload.size:
            return
        del self._assembling[sender]
        self._keep_whole(message, assembly.frames(), assembly.gamma)

    def _hold(self, message: Envelope, gamma: float) -> None:
        """Keep a piece for its turn."""
        self._held.append((message, gamma))

    def _release_held(self) -> None:
        """Route the held pieces again, in the order they came, until none moves on."""
        while self._held:
            held, self._held = self._held, []
            for message, gamma in held:
                self._route_piece(message, gamma)
            if len(self._held) == len(held):
                break

    def _start_at_zero(self, sender: str, replica: Replica) -> None:
        if self._sum is None:
            replica.value = array_module(self.params).zeros_like(self.params)
        elif sender in self._weights:
            replica.value, replica.weight = self._sum, self._weights[sender]

    def _start(self, sender: str, replica: Replica, copy: Array, since: int | None) -> bool:
        """Start ``sender``'s replica from its public copy ``copy`` (whose last q is that of
        round ``since``); False where the summed form keeps no replica of it (not a neighbour)."""
        if self._sum is None:
            replica.value = owned(copy, self.params)
            return True
        weight = self._weights.get(sender)
        if weight is None:
            self.dropped["choco_not_neighbour"] += 1
            return False
        if replica.value is not None:
            if since is not None and replica.next_round == since + 1:
                return True  # (a node that skipped rounds: the sum holds all its copy does)
            self._restart_sum()  # (its part of the sum cannot be taken out alone)
        (copy,) = to_device([copy], self.params)
        add_scaled(self._sum, copy, weight, self._scratch)
        replica.value, replica.weight = self._sum, weight
        return True

    def _weigh_sum(self, weights: Mapping[str, float]) -> None:
        """Weigh the sum by this round's row: started afresh when a neighbour in it left the
        row or changed its weight (a member left, the graph was rebuilt)."""
        started = {j: replica.weight for j, replica in self._replicas.items() if replica.value is not None}
        if any(weights.get(j) != weight for j, weight in started.items()):
            self._restart_sum()
        self._weights = weights

    def _restart_sum(self, counted: bool = True) -> None:
        """Empty the sum: each neighbour's replica starts again from its full copy, which its
        next q asks for (``counted`` in ``sum_restarts``, unless the node itself restarts)."""
        assert self._sum is not None
        self._sum[...] = 0
        for replica in self._replicas.values():
            replica.value = None
        self._streaming.clear()  # (their pieces to come are dropped: the full copies hold them)
        self._held.clear()
        self.sum_restarts += counted

    def _drop_stalled_streams(self) -> None:
        """A q whose pieces stopped coming (its connection closed mid-stream) is part in the
        sum and will not end: the sum starts again."""
        now = self.peer.now()
        if any(now - streaming.heard > STREAM_IDLE_ROUND_TIMEOUTS * self.round_timeout
               for streaming in self._streaming.values()):  # fmt: skip
            self.dropped["choco_stream_cut"] += 1
            self._restart_sum()

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
        self.peer.send(to, CHOCO_FULL, self._published, *self._full_copy())
        self.full_copies_sent += 1

    def _ask_full_copy(self, node: str, replica: Replica) -> None:
        """Request ``node``'s public copy, at most once per round timeout."""
        now = self.peer.now()
        if now - replica.asked_at >= self.round_timeout:
            replica.asked_at = now
            self.peer.send(node, CHOCO_FULL_REQUEST, self.round)

    def _mix(self, r: int, row: MixingRow) -> set[str]:
        if self._sum is not None:
            return self._mix_sum(r, row)
        return self._mix_each(r, row)

    def _mix_sum(self, r: int, row: MixingRow) -> set[str]:
        """x_i += γ (Σ_j w_ij x̂_j - Σ_j w_ij x̂_i) / (1 + age) over the neighbours whose
        replica started, each at the round it has reached, γ the smallest of the pairs' (1 where
        every node runs the default), age that of the oldest: the sum cannot discount one
        neighbour alone. Waiting for every neighbour (``stragglers=wait``), a round in which
        one is late mixes nothing."""
        started = {
            j for j in row.receive_from if (replica := self._replicas.get(j)) and replica.value is not None
        }
        oldest = max([0, *(r + 1 - self._replicas[j].next_round for j in started)])  # (a copy may be ahead)
        if oldest and not self.pace.tolerate:
            return set()
        if not started:
            return started
        assert self._sum is not None
        gamma = min(self._published_gamma, *(self._replicas[j].gamma for j in started)) / (1 + oldest)
        total = sum(self._replicas[j].weight for j in started)
        xp = array_module(self.params)
        for lo in range(0, self.params.size, self._scratch.size):  # (in cache through five passes)
            hi = min(self.params.size, lo + self._scratch.size)
            part = self._scratch[: hi - lo]
            xp.multiply(self.public[lo:hi], -total, out=part)
            part += self._sum[lo:hi]
            if gamma != 1.0:
                part *= gamma
            with np.errstate(over="ignore"):  # an overflow is what the check below catches
                part += self.params[lo:hi]
            if not all_finite(part):  # a diverged neighbour's q's, finite but past float32 once mixed:
                self.rejected["non_finite"] += 1  # the blocks before this one stay mixed
                self._restart_sum()
                return set()
            self.params[lo:hi] = part
        return started

    def _mix_each(self, r: int, row: MixingRow) -> set[str]:
        """x_i += Σ_j γ_ij w_ij (x̂_j - x̂_i) over the neighbours whose replica is at round r,
        γ_ij = min(γ_i, γ_j) at round r (the same on both sides of the pair); tolerating
        stragglers, a replica at an earlier round within its age bound (whether or not its
        node was waited for: see D-PSGD), w_ij divided by (1 + age)."""
        now = self.peer.now()
        usable: set[str] = set()
        total = 0.0
        for j in row.receive_from:
            replica = self._replicas.get(j)
            if replica is None or replica.value is None:
                continue
            age = r + 1 - replica.next_round
            if age and not self.pace.mixes_late(j, age, now):
                continue
            weight = min(self._published_gamma, replica.gamma) * row.receive_from[j] / (1 + age)
            add_scaled(self.params, replica.value, weight, self._scratch)
            total += weight
            usable.add(j)
        add_scaled(self.params, self.public, -total, self._scratch)
        return usable
