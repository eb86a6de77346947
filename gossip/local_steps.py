"""Self-tuning local steps (``--average-every auto``, ``--local-steps auto``): H chosen from what
the nodes measure, one H for the whole mesh per epoch of rounds.

Each node measures the compute time of its local steps and the time a gossip round keeps it
from computing (sending, waiting for its neighbours' values, mixing), and proposes the H at
which rounds take at most :data:`COMM_SHARE` of its time: ``H = (1 - s) / s * round / step``,
within [1, :data:`MAX_H`] (from ``gossip.outer.MIN_LOCAL_STEPS`` with DiLoCo's outer step). So
a slow link, a large model or a slow neighbour raises H and a fast link lowers it again,
re-chosen every epoch.

Agreement, with no coordinator: rounds are grouped in epochs of :data:`EPOCH_ROUNDS`. A node
fixes its proposal at the start of an epoch and every averaging message it sends carries the
largest proposal it has seen for that epoch (``meta["local_steps"]``: epoch, largest proposal,
H in force); each node keeps the largest it receives. After an epoch's rounds the largest
proposal has reached every node within ``EPOCH_ROUNDS - 1`` hops, so on any graph of smaller
diameter (a ring of up to 15 nodes, exponential graphs of any size) every node takes the same H
for the next epoch: H is part of the round schedule, as the graph is. Where a proposal did not
reach a node in time (a lost message, a larger diameter), neighbours differ in H for one epoch;
rounds still pair by number, so that costs waiting, not correctness, and a node that hears
of a larger H in force for its epoch takes it (a joiner, a node resumed from a checkpoint).

A round's cost is only visible where the round mixes what it waits for: ``adpsgd`` and
``overlap`` hide it, and are refused with ``auto``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from gossip.algorithms import Algorithm
from gossip.averager import IncompatibleOptionsError
from gossip.network import Envelope, PeerNetwork, PeerWrapper

EPOCH_ROUNDS = 8
COMM_SHARE = 0.2  # the share of a node's time rounds may take
MAX_H = 256
META_KEY = "local_steps"
RECENT = 16  # measurements a proposal looks at


def check_auto(algorithm: Algorithm) -> None:
    """Raise :class:`IncompatibleOptionsError` unless ``auto`` can measure the algorithm's rounds."""
    if algorithm.mixes_late:
        raise IncompatibleOptionsError(
            f"auto local steps measure what a round costs, which --algorithm {algorithm} hides "
            "(it mixes a round late or in the background); use dpsgd, choco or sgp:overlap=0"
        )


class LocalStepsAgreement:
    """One node's side: its measurements, its proposals and the H in force per epoch."""

    def __init__(self, min_h: int = 1) -> None:
        self.min_h = min_h
        self._in_force: dict[int, int] = {0: min_h}
        self._largest: dict[int, int] = {}  # epoch -> the largest proposal seen for it
        self._step_s: deque[float] = deque(maxlen=RECENT)
        self._round_s: deque[float] = deque(maxlen=RECENT)
        self.history: list[tuple[int, int]] = []  # (first round of an epoch, its H), as decided

    def observe(self, *, step_s: float | None = None, round_s: float | None = None) -> None:
        """A local step's compute time, or a round's, in seconds."""
        if step_s is not None:
            self._step_s.append(step_s)
        if round_s is not None:
            self._round_s.append(round_s)

    def proposal(self) -> int | None:
        """The H this node's measurements call for (None before it has measured both)."""
        if not self._step_s or not self._round_s:
            return None
        step, round_ = statistics.median(self._step_s), statistics.median(self._round_s)
        wanted = (1 - COMM_SHARE) / COMM_SHARE * round_ / max(step, 1e-6)
        return int(min(max(math.ceil(wanted), self.min_h), MAX_H))

    def h_for(self, round: int) -> int:
        """The H before ``round``: the epoch's, decided on first asking (at the epoch's first
        round, once the previous epoch's rounds are done) from the largest proposal seen."""
        epoch = round // EPOCH_ROUNDS
        if epoch not in self._in_force:
            previous = max(e for e in self._in_force if e < epoch)
            self._decide(epoch, self._largest.get(epoch - 1, self._in_force[previous]))
        return self._in_force[epoch]

    def _decide(self, epoch: int, h: int) -> None:
        """Put ``h`` in force for ``epoch`` and enter this node's proposal for it."""
        self._in_force[epoch] = h
        self.history.append((epoch * EPOCH_ROUNDS, h))
        own = self.proposal()
        if own is not None:
            self._take_proposal(epoch, own)
        for old in [e for e in self._in_force if e < epoch - 1]:
            del self._in_force[old]
        for old in [e for e in self._largest if e < epoch]:
            del self._largest[old]

    def outgoing(self, round: int) -> list[int]:
        """What a message of ``round`` carries: [epoch, largest proposal seen, H in force]."""
        epoch = round // EPOCH_ROUNDS
        h = self._in_force.get(epoch, 0)
        return [epoch, self._largest.get(epoch, h), h]

    def incoming(self, value: Any) -> None:
        """Take what a message carried (anything malformed is ignored, and nothing below this
        node's floor is taken: it is a peer's word)."""
        if not (
            isinstance(value, list)
            and len(value) == 3
            and all(type(v) is int for v in value)
            and value[0] >= 0
            and 0 <= value[1] <= MAX_H
            and 0 <= value[2] <= MAX_H
        ):
            return
        epoch, largest, in_force = value
        largest, in_force = (max(v, self.min_h) if v else 0 for v in (largest, in_force))
        newest = max(self._in_force)
        if epoch < newest or epoch > newest + 1:
            return  # an old epoch's, or from too far ahead to place
        if largest:
            self._take_proposal(epoch, largest)  # (before deciding: the sender's is in it)
        if in_force and epoch == newest + 1:
            self._decide(epoch, in_force)  # the sender has decided it already (so would we)
        elif in_force > self._in_force[newest] and epoch == newest:
            # the agreement missed this node (a joiner, a resumed node, a lost message): the
            # larger H wins, so the mesh is back on one H within its diameter in rounds
            self._in_force[newest] = in_force
            self.history.append((newest * EPOCH_ROUNDS, in_force))

    def _take_proposal(self, epoch: int, value: int) -> None:
        self._largest[epoch] = max(self._largest.get(epoch, 0), value)


class AgreeingPeer(PeerWrapper):
    """A ``PeerNetwork`` whose averaging messages carry the local-steps agreement."""

    def __init__(self, peer: PeerNetwork, agreement: LocalStepsAgreement) -> None:
        super().__init__(peer)
        self._agreement = agreement

    def send(
        self,
        to: str,
        kind: str,
        round: int,
        tensors: Sequence[np.ndarray] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self._peer.send(to, kind, round, tensors, {**(meta or {}), META_KEY: self._agreement.outgoing(round)})

    def recv(self, timeout: float, kinds: Collection[str] | None = None) -> Envelope | None:
        message = self._peer.recv(timeout, kinds)
        if message is not None and META_KEY in message.meta:
            self._agreement.incoming(message.meta[META_KEY])
        return message
