"""Asynchronous decentralized parallel SGD: AD-PSGD (Lian et al., ICML 2018).

Training never waits for communication. A background exchanger (which the network starts:
``PeerNetwork.start_background``, an OS thread in a mesh, a coroutine in the simulator) averages
the model with one neighbour at a time: an *active* node sends its model y to a *passive*
neighbour, which atomically replaces its own x with the mean of the two and answers with half
their difference, d = (x - y) / 2 (rounded to the wire's dtypes; the passive moves by exactly
that, x - d, so the pair's sum is kept); the active node then adds d to its model *now*, so the
local steps it took while waiting count in full (the mean of its model now and the passive's
would keep half of them: the mesh would lose the other half). Neither side keeps a copy of its
model for the exchange: the active's request leaves from a copy ZeroMQ frees once sent, and the
passive writes d over the request's own reassembly buffer and answers from it, so an exchange
adds one model's bytes to a node, not two. A passive has several active neighbours; for its
memory to hold one request at a time, an active first asks for a turn (``pair_ask``, no
tensors) and sends its model once given one (``pair_turn``): a passive gives the next turn
when the last request was answered and its answer has left (or after the wait limit), so
requests never pile up in its memory, and the model an active sends is the one it has when
its turn comes. A model of at most ``ASK_ABOVE_BYTES`` on the wire is sent without asking: its
actives' requests cross their links at once, which behind slow links keeps the exchanges
coming (turns cost a slow-linked mesh accuracy: docs/algorithms.md), and two such requests
add little to a node. Nodes are
split into actives and passives by the graph's 2-colouring (even and odd positions when it has
none), so two nodes never wait on each other and exchanges cannot deadlock. A slow node computes slowly
but keeps exchanging at the speed of the network, so its model stays with the others.

Each model carries a version: a node's count of local steps, raised to the partner's on every
exchange (a model that has absorbed a newer one is as new as it). A message whose model is more
than ``max_staleness`` versions behind this node's is dropped and counted.
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from gossip.algorithms.averager import SEND_POLL_S, Averager, AveragerOptions, Needs
from gossip.buffers.arrays import own_memory
from gossip.buffers.vector import mix_into
from gossip.messages import PAIR_ASK, PAIR_DIFFERENCE, PAIR_MODEL, PAIR_TURN, Exchange, PayloadError
from gossip.network import Envelope, PeerNetwork
from topologies import pair_partner

#: a model larger than this on the wire asks its passive partner for a turn before it is sent
ASK_ABOVE_BYTES = 32 << 20

if TYPE_CHECKING:  # (Python 3.11's typing; annotations are not evaluated)
    from typing import Unpack


class ADPSGD(Averager):
    """Args are those of :class:`~gossip.algorithms.averager.Averager` (``round`` is the model version),
    plus ``interval_s``: the least time between two exchanges this node starts."""

    name: ClassVar[str] = "adpsgd"
    kinds: ClassVar[tuple[str, ...]] = (PAIR_ASK, PAIR_TURN, PAIR_MODEL, PAIR_DIFFERENCE)
    needs: ClassVar[Needs] = Needs(static_undirected_graph=True)  # pairs come from the 2-colouring
    mixes_in_background: ClassVar[bool] = True

    def __init__(
        self,
        peer: PeerNetwork,
        params: np.ndarray,
        *,
        max_staleness: int = 1000,
        interval_s: float = 0.005,
        **common: Unpack[AveragerOptions],
    ) -> None:
        super().__init__(peer, params, max_staleness=max_staleness, **common)
        self.interval_s = interval_s
        self.exchanges = 0
        self._exchange_ids = itertools.count(1)
        self._version_lock = threading.Lock()
        self._stop = threading.Event()
        # the passive side: asks waiting for a turn (sender -> exchange, oldest first), the turn
        # given (sender, exchange, until when), the last answer (to whom, waited for until when)
        self._asks: dict[str, int] = {}
        self._turn: tuple[str, int, float] | None = None
        self._answered: tuple[str, float] | None = None
        self._asks_first = peer.wire_bytes(self.layout.nbytes) > ASK_ABOVE_BYTES
        self._exchanger = peer.start_background(f"adpsgd-{peer.node_id}", self._run)

    def after_step(self) -> None:
        with self._version_lock:
            self.round += 1

    def close(self) -> None:
        self._stop.set()
        self._exchanger.join(timeout=5)

    def report(self) -> dict[str, float]:
        return {**super().report(), "exchanges": self.exchanges}

    # -- the exchanger ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            partner = pair_partner(
                self.topology,
                self.peer.members(),
                self.peer.node_id,
                self.exchanges,
                self.peer.not_listening(),
            )
            if partner is not None:
                self._time_round()
                self._exchange(partner)
            self._answer_until(self.peer.now() + (self.interval_s if partner else 0.05))

    def _exchange(self, partner: str) -> None:
        """Ask a passive partner for a turn, send it our model, add the difference it answers;
        or give up where one of them does not come within the wait limit."""
        exchange = next(self._exchange_ids)
        if self._asks_first:
            self.peer.send(partner, PAIR_ASK, self.round, (), Exchange(exchange).encode())
            if self._wait_for(partner, PAIR_TURN, exchange) is None:
                return
        with self.lock:
            request = self.layout.pack(self.params, copy=True)
        self.peer.send(partner, PAIR_MODEL, self.round, request, Exchange(exchange).encode())
        del request  # (the answer is a difference: nothing of what was sent is needed again)
        answer = self._wait_for(partner, PAIR_DIFFERENCE, exchange)
        if answer is not None and self._valid(answer) and self._fresh(answer.round, self.round):
            with self.lock:
                self.layout.add_scaled(self.params, answer.tensors, 1.0, self._scratch)
                self._count_exchange(answer.round)

    def _wait_for(self, partner: str, kind: str, exchange: int) -> Envelope | None:
        """``partner``'s message of ``kind`` for ``exchange``, serving the passive side meanwhile;
        None if it left, or if nothing came within the wait limit (it is then probed)."""
        deadline = self.peer.now() + self.wait_limit()
        while (remaining := deadline - self.peer.now()) > 0 and not self._stop.is_set():
            message = self.peer.recv(remaining, self.kinds)
            if message is None:
                if partner not in self.peer.members():
                    return None
            elif message.kind in (PAIR_ASK, PAIR_MODEL):
                self._serve(message)  # (a node the graph leaves uncoloured is asked too)
            elif (message.sender, message.kind) == (partner, kind) and self._exchange_of(message) == exchange:
                return message
            else:
                self.dropped["stale"] += 1  # a turn or an answer of an exchange given up
            self._give_turn()
        if not self._stop.is_set():
            self.peer.missed(partner)
        return None

    def _answer_until(self, deadline: float) -> None:
        """The passive side until ``deadline``: take asks, give turns, answer requests."""
        while (remaining := deadline - self.peer.now()) > 0 and not self._stop.is_set():
            # (while an answer leaves and an ask waits, look again soon whether it has left)
            leaving = bool(self._asks) and self._turn is None and self._answered is not None
            wait = min(remaining, SEND_POLL_S) if leaving else remaining
            message = self.peer.recv(wait, (PAIR_ASK, PAIR_MODEL))
            if message is not None:
                self._serve(message)
            self._give_turn()

    def _serve(self, message: Envelope) -> None:
        """An active neighbour's ask (queued: its latest, at the back) or request (answered if
        it is the one whose turn it is; else counted and let go). The turn's holder asking again
        has given its exchange up: its turn ends, and it has the new one at once only where no
        one else asks (so no member can hold a passive by asking before each turn runs out)."""
        exchange = self._exchange_of(message)
        if exchange is None:
            return
        if message.kind == PAIR_ASK and self._turn is not None and self._turn[0] == message.sender:
            self.dropped["pair_turn_unused"] += 1
            self._turn = None
            if self._asks:
                self._asks[message.sender] = exchange
            else:
                self._give(message.sender, exchange)
        elif message.kind == PAIR_ASK:
            self._asks.pop(message.sender, None)
            self._asks[message.sender] = exchange
        elif self._its_turn(message.sender, exchange):
            self._turn = None
            if self._answer(message, exchange):
                self._answered = (message.sender, self.peer.now() + self.wait_limit())
        else:
            self.dropped["pair_without_turn"] += 1
        self._give_turn()

    def _its_turn(self, sender: str, exchange: int) -> bool:
        """Whether ``sender``'s request of ``exchange`` is answered now: its turn was given (a
        small model's needs none)."""
        return not self._asks_first or (self._turn is not None and self._turn[:2] == (sender, exchange))

    def _give_turn(self) -> None:
        """Give the next asker its turn once the last one's is over: its request answered and
        the answer gone from this node, the wait limit passed, or its holder gone from the
        membership (a turn given and not taken stays open while nobody else asks). Asks of
        nodes no longer members are forgotten."""
        if not self._asks:
            return
        members = self.peer.members()
        self._asks = {sender: exchange for sender, exchange in self._asks.items() if sender in members}
        if not self._asks:
            return
        now = self.peer.now()
        if self._turn is not None:
            if now < self._turn[2] and self._turn[0] in members:
                return
            self.dropped["pair_turn_unused"] += 1
            self._turn = None
        if self._answered is not None:
            target, until = self._answered
            if now < until and self.peer.backlog(target):
                return
            self._answered = None
        sender = next(iter(self._asks))
        self._give(sender, self._asks.pop(sender))

    def _give(self, sender: str, exchange: int) -> None:
        self.peer.send(sender, PAIR_TURN, self.round, (), Exchange(exchange).encode())
        self._turn = (sender, exchange, self.peer.now() + self.wait_limit())

    def _answer(self, request: Envelope, exchange: int) -> bool:
        """The passive side of an exchange: take the mean, answer with half the difference;
        whether the request was taken."""
        if not (self._valid(request) and self._fresh(request.round, self.round)):
            return False
        version = self.round
        with self.lock:
            answer = self._take_mean(request)
        self.peer.send(request.sender, PAIR_DIFFERENCE, version, answer, Exchange(exchange).encode())
        return True

    def _exchange_of(self, message: Envelope) -> int | None:
        """The exchange an ask, a turn, a request or an answer belongs to; None (counted) if it
        names none."""
        try:
            return Exchange.decode(message.meta).exchange
        except PayloadError:
            self.rejected["bad_payload"] += 1
            return None

    def _take_mean(self, request: Envelope) -> list[np.ndarray]:
        """x <- (x + y) / 2, with y the request's model; the answer d = (x - y) / 2 in the
        request's dtypes, x moved by exactly d as rounded (the caller holds the lock, so the
        exchange is atomic). d is written over the request's frames where their memory is the
        message's own, block by block: y's block is read before d's is written."""
        answer = [own if (own := own_memory(y)) is not None else np.empty_like(y) for y in request.tensors]
        start = 0
        for frame, out in zip(request.tensors, answer, strict=True):
            for i in range(0, frame.size, self._scratch.size):
                block = self._scratch[: min(self._scratch.size, frame.size - i)]
                x = self.params[start + i : start + i + block.size]
                np.copyto(block, frame[i : i + block.size], casting="same_kind")
                np.subtract(x, block, out=block)
                block *= 0.5
                np.copyto(out[i : i + block.size], block, casting="same_kind")
                if out.dtype != block.dtype:  # (x moves by d as sent)
                    np.copyto(block, out[i : i + block.size], casting="same_kind")
                np.negative(block, out=block)
                mix_into(x, block)
            start += frame.size
        self._count_exchange(request.round)
        return answer

    def _count_exchange(self, version: int) -> None:
        with self._version_lock:
            self.round = max(self.round, version)
        self.exchanges += 1
