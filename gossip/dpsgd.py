"""Synchronous decentralized averaging: D-PSGD (Lian et al., NeurIPS 2017).

After a local step, node i sends its parameters x_i to the nodes it sends to in round r, waits a
bounded time for the values of the nodes it receives from, and mixes
``x_i <- sum_j W_ij x_j`` over what arrived, with the weights renormalised so they still sum to
one. With every message on time and a doubly-stochastic W the mean of all models is preserved
exactly. The graph may be directed or change every round (``one-peer-exponential``,
``random-matching``): each round's row comes from the topology.

The wait is derived from measured round times, not guessed: ``WAIT_FACTOR`` times the median of
the recent rounds (steps included), within ``[MIN_WAIT_S, round_timeout]``, so a crashed or
paused neighbour stalls the others for a few typical rounds, not seconds. A neighbour that
misses a round is not waited for again until any message of its arrives (an on-time one, or a
late one from a neighbour that is behind and catching up), so a dead peer costs one wait, not one
per round, until the membership drops it. Rows come from the
membership of the round (``peer.members(round)``): a node that left after round R is part of the
graph up to R and gone from R + 1 on every node, and it is not waited for past its last round.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections import Counter, defaultdict, deque
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np

from gossip.network import Envelope, PeerNetwork
from topologies import MixingRow, Topology, mixing_row

WAIT_FACTOR = 10.0
MIN_WAIT_S = 0.05
RECENT_ROUNDS = 32
KIND = "params"
KINDS = (KIND,)
log = logging.getLogger(__name__)
_MIX_CHUNK = 1 << 20  # elements mixed per vector op: bounds the scratch memory


@dataclass(frozen=True)
class RoundStats:
    round: int
    expected: int  # values this node waited for
    arrived: int
    wait_s: float
    topology: Topology  # the graph used this round (the fallback where the chosen one is undefined)


class DPSGD:
    """Averages ``params`` (a flat numpy view of the model) with the neighbours each round.

    Args:
        peer: the node's network (``p2p.Peer`` or a simulator).
        params: the flat parameter buffer, modified in place by :meth:`average`.
        topology: the graph (or schedule) to average on.
        round_timeout: the longest a round ever waits for a neighbour, in seconds (the wait
            before there is a history of rounds, and the cap of the adaptive wait).
        lock: held while ``params`` is written, so readers (evaluation) see whole updates.
        max_rounds_ahead: how far ahead of this node a neighbour's message may be and still
            be kept for its round.
    """

    def __init__(
        self,
        peer: PeerNetwork,
        params: np.ndarray,
        *,
        topology: Topology,
        round_timeout: float,
        lock: AbstractContextManager[object] | None = None,
        max_rounds_ahead: int = 64,
    ) -> None:
        self.peer = peer
        self.params = params
        self.topology = topology
        self.round_timeout = round_timeout
        self._round_times: deque[float] = deque(maxlen=RECENT_ROUNDS)
        self._last_start: float | None = None
        self.round = 0
        self.rejected: Counter[str] = Counter()  # malformed: wrong kind, dtype, shape, NaN...
        self.dropped: Counter[str] = Counter()  # well-formed but out of time: stale, too far ahead
        self.fallback_rounds = 0
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._max_ahead = max_rounds_ahead
        self._early: defaultdict[int, dict[str, np.ndarray]] = defaultdict(dict)
        self._not_waited: set[str] = set()
        self._scratch = np.empty(min(params.size, _MIX_CHUNK), dtype=params.dtype)

    def wait_limit(self) -> float:
        """How long this round may wait for a neighbour."""
        if len(self._round_times) < RECENT_ROUNDS // 4:
            return self.round_timeout
        return min(self.round_timeout, max(MIN_WAIT_S, WAIT_FACTOR * statistics.median(self._round_times)))

    def average(self) -> RoundStats:
        """One gossip round: send, gather (bounded), mix."""
        now = time.monotonic()
        if self._last_start is not None:
            self._round_times.append(now - self._last_start)
        self._last_start = now
        r = self.round
        row = mixing_row(self.topology, self.peer.members(r), self.peer.node_id, r)
        snapshot = self.params.copy()  # what we send must not change while it is in flight
        for target in row.send_to:
            self.peer.send(target, KIND, r, [snapshot])
        started = time.monotonic()
        arrived = self._gather(r, row)
        wait_s = time.monotonic() - started
        with self._lock:
            self._mix(snapshot, row, arrived)
        self.round += 1
        if row.topology != self.topology and self.fallback_rounds == 0:
            log.warning(
                "%s is not defined for %d members: averaging on %s until it is",
                self.topology,
                len(self.peer.members(r)),
                row.topology,
            )
        self.fallback_rounds += row.topology != self.topology
        return RoundStats(r, len(row.receive_from), len(arrived), wait_s, row.topology)

    def _gather(self, r: int, row: MixingRow) -> dict[str, np.ndarray]:
        got = self._early.pop(r, {})
        waiting = set(row.receive_from) - got.keys() - self._not_waited
        deadline = time.monotonic() + self.wait_limit()
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            message = self.peer.recv(remaining, KINDS)
            if message is None:
                waiting &= self.peer.members(r)  # a neighbour that left is not waited for
            else:
                self._file(message, r, got)
                waiting -= got.keys()
        while (message := self.peer.recv(0, KINDS)) is not None:  # whatever else is already here
            self._file(message, r, got)
        for silent in waiting - self._not_waited:
            self.peer.missed(silent)  # the membership probes it now rather than in its turn
        self._not_waited |= waiting
        return {j: got[j] for j in row.receive_from if j in got}

    def _file(self, message: Envelope, r: int, got: dict[str, np.ndarray]) -> None:
        """Keep a neighbour's parameters for their round, or count why not."""
        problem = self._problem(message)
        if problem is not None:
            self.rejected[problem] += 1
            return
        self._not_waited.discard(message.sender)  # it is alive: wait for it again
        if message.round < r or message.round > r + self._max_ahead:
            self.dropped["stale" if message.round < r else "too_far_ahead"] += 1
            return
        (got if message.round == r else self._early[message.round])[message.sender] = message.tensors[0]

    def _problem(self, message: Envelope) -> str | None:
        if message.kind != KIND:
            return "unexpected_kind"
        if len(message.tensors) != 1:
            return "tensor_count"
        tensor = message.tensors[0]
        if tensor.dtype != self.params.dtype or tensor.shape != self.params.shape:
            return "tensor_mismatch"
        if not all_finite(tensor):
            return "non_finite"
        return None

    def _mix(self, own: np.ndarray, row: MixingRow, arrived: Mapping[str, np.ndarray]) -> None:
        row = row.renormalized(arrived)
        np.multiply(own, row.self_weight, out=self.params)
        for sender, theirs in arrived.items():
            _add_scaled(self.params, theirs, row.receive_from[sender], self._scratch)


def all_finite(array: np.ndarray) -> bool:
    """True when no element is NaN or infinite (checked in chunks: no model-sized temporary)."""
    flat = array.reshape(-1)
    return all(bool(np.isfinite(flat[i : i + _MIX_CHUNK]).all()) for i in range(0, flat.size, _MIX_CHUNK))


def _add_scaled(y: np.ndarray, x: np.ndarray, a: float, scratch: np.ndarray) -> None:
    """y += a * x, chunk by chunk through ``scratch``."""
    for i in range(0, y.size, scratch.size):
        part = scratch[: min(scratch.size, y.size - i)]
        np.multiply(x[i : i + part.size], a, out=part)
        y[i : i + part.size] += part
