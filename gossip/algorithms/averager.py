"""What every averaging algorithm shares: the flat parameters, the wait policy, each round's row
of the topology, message checks, staleness bounds and the counters a node reports.

An algorithm subclasses :class:`Averager` and implements :meth:`Averager.after_step`, which the
training loop calls after local steps; synchronous algorithms gossip there, asynchronous ones
only signal their background exchange.

When training ends, :meth:`Averager.finish` mixes once more, the same way for every algorithm:
each node sends its final model to its neighbours of its last round (of round 0's graph on a
time-varying topology) and mixes theirs in, piece by piece as they come, waiting for each until
it is in, its sender left without one, or ``FINAL_WAIT_S`` passed. Tolerant rounds leave a node
that mixed stale or few values (behind a slow link, or passed over) further from the others than
its neighbours are from each other; the models a run leaves behind are what users keep, and one
exchange in which every neighbour is waited for brings them together.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

import numpy as np

from gossip.algorithms.robust import RobustRule
from gossip.buffers.pieces import RunningMix, Segments
from gossip.buffers.vector import Layout, SendCopy, all_finite, scratch_for
from gossip.messages import FINAL
from gossip.network import Envelope, PeerNetwork
from topologies import FAMILIES, MixingRow, Topology, mixing_row

if TYPE_CHECKING:  # (Python 3.11's typing; annotations are not evaluated)
    from typing import Required, Unpack

WAIT_FACTOR = 10.0
FINAL_WAIT_S = 5.0  # the longest the final exchange waits for the neighbours' models
MIN_WAIT_S = 0.05
SEND_POLL_S = 0.001  # how often a node looks whether its last sends have left (see _send_frames)
RECENT_ROUNDS = 32
log = logging.getLogger(__name__)


class IncompatibleOptionsError(ValueError):
    """Options that do not go together; the message names them as the library's arguments
    (``compression=int8``) and what to use (the command line says ``--compression int8``)."""


@dataclass(frozen=True)
class Needs:
    """What an algorithm works with, declared once on its class and checked by
    :meth:`gossip.algorithms.registry.Algorithm.check` (for the command line and the library, before a
    node opens a socket); an averager made directly checks its graph itself."""

    static_undirected_graph: bool = False  # a fixed graph whose every edge runs both ways
    compression: bool = False  # takes a codec (the others send whole models)
    robust_mixing: bool = False  # takes a Byzantine-robust mixing rule

    def check_graph(self, algorithm: str, topology: Topology) -> None:
        if self.static_undirected_graph and (topology.family.directed or topology.family.time_varying):
            examples = [
                name
                for name, family in FAMILIES.items()
                if not (family.directed or family.time_varying) and name != "file"
            ]
            raise IncompatibleOptionsError(
                f"algorithm={algorithm} needs a static undirected topology= "
                f"({', '.join(examples[:4])}, ...), not {topology}"
            )


@dataclass(frozen=True)
class RoundStats:
    round: int
    expected: int  # values this node waited for
    arrived: int
    wait_s: float
    topology: Topology  # the graph used this round (the fallback where the chosen one is undefined)


@dataclass
class Staleness:
    """How old the messages were that a node mixed in (in rounds, or model versions)."""

    accepted: int = 0
    total: int = 0
    max: int = 0

    def add(self, age: int) -> None:
        self.accepted += 1
        self.total += age
        self.max = max(self.max, age)

    def summary(self, dropped: int) -> dict[str, float]:
        mean = self.total / self.accepted if self.accepted else 0.0
        return {"mean": round(mean, 3), "max": self.max, "accepted": self.accepted, "dropped": dropped}


ROUND_TIMEOUT_S = 2.0


class AveragerOptions(TypedDict, total=False):
    """The keywords every averager takes, declared once (each algorithm adds its own).

    topology: the graph (or schedule) to average on.
    round_timeout: the longest any wait for a neighbour lasts, in seconds (before there is a
        history of rounds, and as the cap of the adaptive wait); default ``ROUND_TIMEOUT_S``.
    lock: held while ``params`` is written, so readers (evaluation, the optimizer) never see
        half an update; None: no lock.
    layout: how model values go on the wire (``FlatParameters.layout``: bfloat16 buckets in 2
        bytes); None: the vector as it is. Algorithms that send other values than the model's
        (push-sum numerators, CHOCO's replicas) send them as the vector is.
    """

    topology: Required[Topology]
    round_timeout: float
    lock: AbstractContextManager[object] | None
    layout: Layout | None


class Averager:
    """Base of the algorithms; see the module docstring.

    Args:
        peer: the node's network (``p2p.Peer`` or the in-memory network).
        params: the flat parameter buffer (a numpy view of the model), mixed in place.
        max_staleness: the oldest message (in rounds behind this node) that is still mixed in;
            older ones are dropped and counted.
        common: :class:`AveragerOptions`.
    """

    name: ClassVar[str]  # as Algorithm.parse spells it
    kinds: ClassVar[tuple[str, ...]] = ()  # message kinds this algorithm reads
    needs: ClassVar[Needs] = Needs()
    #: whether parameters are mixed outside after_step (by a background exchanger), at any time
    mixes_in_background: ClassVar[bool] = False
    robust: RobustRule | None = None  # a Byzantine-robust mixing rule (dpsgd's option)

    def __init__(
        self,
        peer: PeerNetwork,
        params: np.ndarray,
        *,
        max_staleness: int = 0,
        **common: Unpack[AveragerOptions],
    ) -> None:
        if "topology" not in common:
            raise TypeError(f"{type(self).__name__} needs topology= (the graph to average on)")
        topology, layout, lock = common["topology"], common.get("layout"), common.get("lock")
        self.needs.check_graph(self.name, topology)
        self.peer = peer
        peer.take_pieces((FINAL,))  # (mixed as they come by finish; see piece_kinds)
        self.params = params
        self.vector_layout = Layout.of(params)  # the vector as it is (push-sum shares, replicas)
        self.layout = layout or self.vector_layout  # model values as the model holds them
        self.topology = topology
        self.round_timeout = common.get("round_timeout", ROUND_TIMEOUT_S)
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.max_staleness = max_staleness
        self.round = 0
        self.skip_limit: int | None = None  # the furthest a catch-up skip reaches (the optimizer's)
        self.overlap = 0  # rounds between sending a value and mixing it (set by the algorithms)
        self.rejected: Counter[str] = Counter()  # malformed messages
        self.dropped: Counter[str] = Counter()  # well-formed ones that came too late or too early
        self.staleness = Staleness()
        self.fallback_rounds = 0
        self._scratch = scratch_for(params)
        self._send_copy = SendCopy(self.layout)  # what the model's values are sent from
        self._sent_to: list[str] = []  # the neighbours the last value went to
        self._round_times: deque[float] = deque(maxlen=RECENT_ROUNDS)
        self._last_start: float | None = None
        self._silent: set[str] = set()  # neighbours not waited for until heard from again
        # told of each message the algorithm took in (the mesh's agreements read what it carries;
        # dpsgd, sgp and choco tell: the algorithms agreements run with)
        self.on_accepted: Callable[[Envelope], None] | None = None

    def after_step(self) -> RoundStats | None:
        """Called by the training loop after its local steps; returns the round's figures when
        the algorithm gossiped synchronously."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop background work (asynchronous algorithms)."""

    def finish(self, wait_s: float = FINAL_WAIT_S) -> RoundStats:
        """The final exchange (see the module docstring), once training ended and background
        work stopped: what was expected and what came. With a Byzantine-robust rule nothing
        is exchanged: the models stay as its rounds left them (a plain mix would let an
        insider's model in)."""
        if self.robust is not None:
            return RoundStats(self.round, 0, 0, 0.0, self.topology)
        last = max(self.round - 1, 0)
        members = self.peer.members(last) | {self.peer.node_id}
        graph_round = 0 if self.topology.family.time_varying else last
        row = mixing_row(self.topology, members, self.peer.node_id, graph_round, self.peer.not_listening())
        frames = self._send_frames()  # (mixing below writes the vector)
        self._sent_to = list(row.send_to)
        for target in row.send_to:
            self.peer.send(target, FINAL, self.round, frames)
        mix = RunningMix(self.params, self.layout, row.self_weight, self._scratch, self.lock)

        def take(message: Envelope) -> None:
            if message.sender in row.receive_from:
                self._add(mix, message.sender, message, row.receive_from[message.sender])

        started = self.peer.now()
        deadline = started + wait_s
        waiting = set(row.receive_from)
        while waiting and (remaining := deadline - self.peer.now()) > 0:
            if self._receive(remaining, (FINAL,), take):
                waiting = {j for j in waiting if not mix.complete(j)}
            else:  # (or a membership change: one that left sent what it had)
                waiting &= self.peer.members()
        while self._receive(0, (FINAL,), take):
            pass
        arrived = len(mix.senders & row.receive_from.keys())
        return RoundStats(self.round, len(row.receive_from), arrived, self.peer.now() - started, row.topology)

    @classmethod
    def piece_kinds(cls, options: Mapping[str, Any]) -> tuple[str, ...]:
        """The message kinds an averager built with ``options`` (its keyword arguments) takes
        piece by piece as they arrive: declared to the network before it is built
        (``PeerNetwork.take_pieces``), so that a neighbour's first value, which may come
        first, is not assembled whole (a model's bytes more, held until the round mixes)."""
        return (FINAL,)

    def restart(self, round: int) -> None:
        """Continue from ``round`` with the parameters as they are now (after taking another
        node's state)."""
        self.round = round

    def report(self) -> dict[str, float]:
        return self.staleness.summary(self.dropped["stale"])

    # -- shared machinery ---------------------------------------------------------------------

    def wait_limit(self) -> float:
        """How long one wait for a neighbour may last: WAIT_FACTOR times the median of recent
        round times, within [MIN_WAIT_S, round_timeout]."""
        if len(self._round_times) < RECENT_ROUNDS // 4:
            return self.round_timeout
        return min(self.round_timeout, max(MIN_WAIT_S, WAIT_FACTOR * statistics.median(self._round_times)))

    def _send_frames(self, stragglers: Callable[[set[str]], set[str]] | None = None) -> list[np.ndarray]:
        """The model's values now, copied for sending (in the buckets' dtypes: a bfloat16
        model's in half its float32 vector's bytes). The last copy is reused once its sends have
        left; where they still go out to neighbours other than ``stragglers`` (of those given)
        and the silent ones, whose next values come after they took the last, they are waited
        for, up to the round's wait limit: a node in step with its neighbours holds one copy of
        its model for sending, not two. The limit is one of silence: while what is left to send
        goes down, the wait goes on (a model that takes longer than the limit to cross its
        link). A straggler's link is not waited for: the copy it holds is left to it, and a new
        one made."""
        lagging = {t for t in self._sent_to if self.peer.backlog(t)}
        passed_over = (stragglers(lagging) if stragglers and lagging else set()) | self._silent
        if lagging and not lagging & passed_over:
            deadline = self.peer.now() + self.wait_limit()
            left = sum(self.peer.backlog(t) for t in lagging)
            while self._send_copy.held and self.peer.now() < deadline:
                self.peer.recv(SEND_POLL_S, ())  # (a pause on the network's clock: takes nothing)
                if (now_left := sum(self.peer.backlog(t) for t in lagging)) < left:
                    deadline, left = self.peer.now() + self.wait_limit(), now_left
        return self._send_copy.pack(self.params)

    def _receive(self, timeout: float, kinds: tuple[str, ...], take: Callable[[Envelope], None]) -> bool:
        """Hand the next message of ``kinds`` that comes within ``timeout`` s to ``take``, and
        let go of it: a piece's bytes are released as soon as its reader is done with them, and
        with them its sender's credit for more (``p2p.transport.credits``). False when none came
        (or the membership changed)."""
        message = self.peer.recv(timeout, kinds)
        if message is None:
            return False
        take(message)
        return True

    def _time_round(self) -> None:
        now = self.peer.now()
        if self._last_start is not None:
            self._round_times.append(now - self._last_start)
        self._last_start = now

    def _heard_from(self, sender: str) -> None:
        """Any message shows a neighbour is alive: wait for it again."""
        self._silent.discard(sender)

    def _accepted(self, message: Envelope) -> None:
        """``message`` passed this algorithm's checks and is taken in: only now may what else
        it carries be read (:attr:`on_accepted`), never from a message the algorithm refused."""
        if self.on_accepted is not None:
            self.on_accepted(message)

    def _went_silent(self, nodes: Iterable[str]) -> None:
        """Neighbours that sent nothing in time: have the failure detector probe them now (once)
        and do not wait for them again until they are heard from, so a dead peer costs one wait,
        not one per round, until the membership drops it."""
        for node in set(nodes) - self._silent:
            self.peer.missed(node)
            self._silent.add(node)

    def _row(self, r: int, topology: Topology | None = None) -> MixingRow:
        """This node's row of round ``r`` on ``topology`` (default: the averager's), from the
        membership of that round."""
        topology = topology or self.topology
        members = self.peer.members(r)
        row = mixing_row(topology, members, self.peer.node_id, r, self.peer.not_listening())
        if row.topology != topology:
            if self.fallback_rounds == 0:
                log.warning(
                    "%s is not defined for %d members: averaging on %s until it is",
                    topology,
                    len(members),
                    row.topology,
                )
            self.fallback_rounds += 1
        return row

    def _valid(self, message: Envelope, layout: Layout | None = None, extra: int = 0) -> bool:
        """Check a message before any of it is used: kind, that its first tensors are a vector
        of ``layout`` (default: model values, :attr:`layout`) followed by ``extra`` others,
        finiteness. Counts what is wrong."""
        layout = layout or self.layout
        problem = None
        if message.kind not in self.kinds:
            problem = "unexpected_kind"
        elif len(message.tensors) != len(layout.buckets) + extra:
            problem = "tensor_count"
        else:
            problem = layout.problem(message.tensors[: len(layout.buckets)])
        if problem is None and not all(all_finite(t) for t in message.tensors):
            problem = "non_finite"
        if problem is not None:
            self.rejected[problem] += 1
        return problem is None

    def _add(self, mix: RunningMix, key: Hashable, message: Envelope, weight: float | Segments) -> bool:
        """Mix ``message`` (a value, or a piece of one) into ``mix`` as ``key``'s with
        ``weight``; counts why not. Whether it was taken."""
        problem = mix.add(key, message.tensors, message.piece, weight)
        if problem == "refused_message":  # (a piece of a message refused before)
            self.dropped[problem] += 1
        elif problem is not None:
            self.rejected[problem] += 1
        return problem is None

    def _fresh(self, message_round: int, now_round: int) -> bool:
        """Whether a message from ``message_round`` is within the staleness bound at
        ``now_round``; a stale one is counted as dropped."""
        age = now_round - message_round
        if age > self.max_staleness:
            self.dropped["stale"] += 1
            return False
        self.staleness.add(max(age, 0))
        return True
