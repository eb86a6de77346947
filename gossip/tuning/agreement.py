"""One value for the whole mesh per epoch of rounds, agreed with no coordinator: the self-tuning
options (``average_every="auto"``: H, ``gossip.tuning.auto_period``; ``compression=auto``: the codec,
``gossip.tuning.auto_codec``) each run one :class:`EpochAgreement` on an integer.

Rounds are grouped in epochs of :data:`EPOCH_ROUNDS`. A node fixes its proposal (from what it
measured) at the start of an epoch and every averaging message it sends carries, under the
agreement's meta key, ``[epoch, largest proposal seen for it, value in force]``; each node keeps
the largest proposal it receives, from a message its algorithm accepted (:class:`AgreeingPeer`)
and within its own floor and cap. After an epoch's rounds the largest proposal has reached every
node within ``EPOCH_ROUNDS - 1`` hops, so on any graph of smaller diameter (a ring of up to 15
nodes, exponential graphs of any size) every node takes the same value for the next epoch: it is
part of the round schedule, as the graph is. Where a proposal did not reach a node in time (a
lost message, a larger diameter), neighbours differ for one epoch, and a node that hears of a
larger value in force for its epoch takes it (a joiner, a node resumed from a checkpoint).

The largest wins because each value is ordered from cheap to safe: more local steps, or more
compression, is what a node on a slow link needs, and the mesh goes at its slowest link's pace.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gossip.network import Envelope, PeerNetwork, PeerWrapper

EPOCH_ROUNDS = 8
COMM_SHARE = 0.2  # the share of a node's time rounds may take (what both tuners aim at)
RECENT = 16  # measurements a proposal looks at


class EpochAgreement:
    """One node's side of one agreement on a value in [``floor``, ``cap``], ``start`` in force
    for the first epoch; subclasses say what this node proposes (:meth:`proposal`)."""

    meta_key = "agreement"  # where averaging messages carry it

    def __init__(self, floor: int, cap: int, start: int) -> None:
        self.floor, self.cap = floor, cap
        self._in_force: dict[int, int] = {0: start}
        self._largest: dict[int, int] = {}  # epoch -> the largest proposal seen for it
        self._epoch = 0  # the epoch of this node's newest round
        self.history: list[tuple[int, int]] = []  # (first round of an epoch, its value), as decided

    def proposal(self) -> int | None:
        """The value this node's measurements call for (None: nothing measured yet)."""
        raise NotImplementedError

    def value_for(self, round: int) -> int:
        """The value for ``round``: its epoch's, decided on first asking (at the epoch's first
        round, once the previous epoch's rounds are done) from the largest proposal seen."""
        epoch = round // EPOCH_ROUNDS
        if epoch not in self._in_force:
            # (a round older than every epoch kept, which no round asks for, takes the oldest's)
            previous = max((e for e in self._in_force if e < epoch), default=min(self._in_force))
            self._decide(epoch, self._largest.get(epoch - 1, self._in_force[previous]))
        self._epoch = max(self._epoch, epoch)
        return self._in_force[epoch]

    def outgoing(self, round: int) -> list[int | None]:
        """What a message of ``round`` carries: [epoch, largest proposal seen, value in force]
        (None where this node has none)."""
        epoch = round // EPOCH_ROUNDS
        value = self._in_force.get(epoch)
        return [epoch, self._largest.get(epoch, value), value]

    def incoming(self, carried: Any) -> None:
        """Take what an accepted message carried: anything malformed, or beyond this node's cap,
        is ignored, and any value is raised to this node's floor (it is a peer's word)."""
        if not (isinstance(carried, list) and len(carried) == 3 and type(carried[0]) is int):
            return
        epoch, largest, in_force = carried
        if not all(v is None or (type(v) is int and 0 <= v <= self.cap) for v in (largest, in_force)):
            return
        if epoch < self._epoch or epoch > self._epoch + 1:
            return  # an old epoch's, or from too far ahead of this node's rounds to place
        if largest is not None:
            self._take_proposal(epoch, max(largest, self.floor))  # (before deciding: the sender's is in it)
        if in_force is None:
            return
        in_force = max(in_force, self.floor)
        if epoch not in self._in_force:
            self._decide(epoch, in_force)  # the sender has decided it already (so would we)
        elif in_force > self._in_force[epoch]:
            # the agreement missed this node (a joiner, a resumed node, a lost message): the
            # larger value wins, so the mesh is back on one within its diameter in rounds
            self._in_force[epoch] = in_force
            self.history.append((epoch * EPOCH_ROUNDS, in_force))

    def _decide(self, epoch: int, value: int) -> None:
        """Put ``value`` in force for ``epoch`` and enter this node's proposal for it."""
        self._in_force[epoch] = value
        self.history.append((epoch * EPOCH_ROUNDS, value))
        own = self.proposal()
        if own is not None:
            self._take_proposal(epoch, min(max(own, self.floor), self.cap))
        for old in [e for e in self._in_force if e < epoch - 1]:
            del self._in_force[old]
        for old in [e for e in self._largest if e < epoch]:
            del self._largest[old]

    def _take_proposal(self, epoch: int, value: int) -> None:
        self._largest[epoch] = max(self._largest.get(epoch, self.floor), value)


class AgreeingPeer(PeerWrapper):
    """A ``PeerNetwork`` whose averaging messages carry the node's agreements. What a received
    message carries is taken only once its algorithm accepted the message (:meth:`accepted`,
    the averager's ``on_accepted``): a message the algorithm refuses moves no agreement."""

    def __init__(self, peer: PeerNetwork, agreements: Sequence[EpochAgreement]) -> None:
        super().__init__(peer)
        self._agreements = {agreement.meta_key: agreement for agreement in agreements}

    def send(
        self,
        to: str,
        kind: str,
        round: int,
        tensors: Sequence[np.ndarray] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        meta = dict(meta or {})
        for key, agreement in self._agreements.items():
            if key in meta:
                raise ValueError(
                    f"a {kind} message has its own meta[{key!r}]: rename the agreement's meta_key"
                )
            meta[key] = agreement.outgoing(round)
        self._peer.send(to, kind, round, tensors, meta)

    def accepted(self, message: Envelope) -> None:
        """Take what ``message``, which the algorithm accepted, carries for each agreement."""
        for key, agreement in self._agreements.items():
            if key in message.meta:
                agreement.incoming(message.meta[key])
