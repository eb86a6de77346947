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
adds one model's bytes to a node, not two. Nodes are
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

from gossip.algorithms.averager import Averager, AveragerOptions, Needs
from gossip.buffers.arrays import own_memory
from gossip.buffers.vector import mix_into
from gossip.messages import PAIR_DIFFERENCE, PAIR_REQUEST, Exchange, PayloadError
from gossip.network import Envelope, PeerNetwork
from topologies import pair_partner

if TYPE_CHECKING:  # (Python 3.11's typing; annotations are not evaluated)
    from typing import Unpack


class ADPSGD(Averager):
    """Args are those of :class:`~gossip.algorithms.averager.Averager` (``round`` is the model version),
    plus ``interval_s``: the least time between two exchanges this node starts."""

    name: ClassVar[str] = "adpsgd"
    kinds: ClassVar[tuple[str, ...]] = (PAIR_REQUEST, PAIR_DIFFERENCE)
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
        """Send our model to a passive partner and mix in its answer (or give up, bounded)."""
        exchange = next(self._exchange_ids)
        with self.lock:
            request = self.layout.pack(self.params, copy=True)
        self.peer.send(partner, PAIR_REQUEST, self.round, request, Exchange(exchange).encode())
        del request  # (the answer is a difference: nothing of what was sent is needed again)
        deadline = self.peer.now() + self.wait_limit()
        while (remaining := deadline - self.peer.now()) > 0 and not self._stop.is_set():
            message = self.peer.recv(remaining, self.kinds)
            if message is None:
                if partner not in self.peer.members():
                    return
            elif message.kind == PAIR_REQUEST:
                self._answer(message)
            elif message.sender == partner and self._exchange_of(message) == exchange:
                if self._valid(message) and self._fresh(message.round, self.round):
                    with self.lock:
                        self.layout.add_scaled(self.params, message.tensors, 1.0, self._scratch)
                        self._count_exchange(message.round)
                return
            else:
                self.dropped["stale"] += 1  # the answer to an exchange already given up
        if not self._stop.is_set():
            self.peer.missed(partner)

    def _answer_until(self, deadline: float) -> None:
        while (remaining := deadline - self.peer.now()) > 0 and not self._stop.is_set():
            message = self.peer.recv(remaining, (PAIR_REQUEST,))
            if message is not None:
                self._answer(message)

    def _answer(self, request: Envelope) -> None:
        """The passive side: take the mean, answer with half the difference."""
        exchange = self._exchange_of(request)
        if exchange is None or not (self._valid(request) and self._fresh(request.round, self.round)):
            return
        version = self.round
        with self.lock:
            answer = self._take_mean(request)
        self.peer.send(request.sender, PAIR_DIFFERENCE, version, answer, Exchange(exchange).encode())

    def _exchange_of(self, message: Envelope) -> int | None:
        """The exchange a request or reply belongs to; None (counted) if it names none."""
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
