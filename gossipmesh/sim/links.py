"""The peer interface in virtual time: links with latency and bandwidth, loss, partitions, crashes.

A message leaves its sender's uplink in order (one at a time, each taking bytes / bandwidth of the
link it goes over) and arrives ``latency`` later: a lone message takes latency + bytes / bandwidth,
and a node sending to many neighbours pays for each copy. Downlinks are not modelled. Membership is
exact, as on the in-memory network (``gossipmesh.sim.memory.Roster``), except that a crashed node
stays a member until the others would have detected it (``detect_s``), and a waiting node hears of
a change ``MEMBERSHIP_NEWS_S`` after it. As in a daemon, nothing is sent to a node that is no
longer a member, and what waits on an uplink for one that leaves (or is found dead) is dropped
rather than carried: the messages behind it leave that much sooner.

Only one simulated thread runs at a time (``gossipmesh.sim.clock``), so sends, loss draws and deliveries
happen in one deterministic order. A node's background work (AD-PSGD's exchanger) is a
coroutine on the clock too, and stops with its node.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gossipmesh.sim.clock import SimThread, VirtualClock
from gossipmesh.sim.memory import Roster, read_only
from p2p.wire import Message

LOSS_STREAM = 1  # seed stream of the loss draws
# a membership change wakes the waiting nodes this long after it (news of one takes longer on a
# real mesh), once for every change in that time: thousands of nodes that start or finish
# together wake each waiter once, not once per node
MEMBERSHIP_NEWS_S = 0.001


@dataclass(frozen=True)
class Link:
    """One direction of a link: a message takes ``latency_s + bytes / bandwidth_bps`` on it."""

    latency_s: float = 0.0
    bandwidth_bps: float = math.inf  # bytes per second

    def transfer_s(self, nbytes: float) -> float:
        return nbytes / self.bandwidth_bps


@dataclass(eq=False)
class Transmission:
    """A message on its sender's uplink, from ``start`` to ``end`` (virtual s); ``version``
    changes when it is moved earlier, so that only its latest arrival event delivers it. A
    message lost or dropped is let go of (None): its tensors may be the sender's to reuse."""

    to: str
    message: Message | None
    link: Link
    start: float
    end: float
    version: int = 0


def _free_from(uplink: deque[Transmission], now: float) -> float:
    """When a message queued now on ``uplink`` begins to leave it."""
    return max(uplink[-1].end if uplink else now, now)


@dataclass(frozen=True)
class Partition:
    """From ``start_s`` to ``end_s`` no message crosses between ``side`` and the other nodes."""

    start_s: float
    end_s: float
    side: frozenset[str]

    def cuts(self, a: str, b: str, now: float) -> bool:
        return self.start_s <= now < self.end_s and (a in self.side) != (b in self.side)


class VirtualNetwork:
    """The shared medium of a simulation.

    Args:
        clock: the virtual clock every peer waits on.
        link: every link's latency and bandwidth, unless ``links`` names the pair.
        links: (sender, receiver) -> Link, for heterogeneous links.
        loss: the probability that any one message is lost.
        partitions: when and where the network is cut.
        byte_scale: bytes on the wire per byte of tensor sent (a simulation averages small vectors
            that stand for a model of ``byte_scale`` times their size).
        seed: seeds the loss draws.
    """

    def __init__(
        self,
        clock: VirtualClock,
        *,
        link: Link = Link(),
        links: Mapping[tuple[str, str], Link] | None = None,
        loss: float = 0.0,
        partitions: Sequence[Partition] = (),
        byte_scale: float = 1.0,
        seed: int = 0,
    ) -> None:
        if not 0 <= loss < 1:
            raise ValueError(f"message loss must be in [0, 1), got {loss}")
        self.clock = clock
        self.link = link
        self.links = dict(links or {})
        self.loss = loss
        self.partitions = tuple(partitions)
        self.byte_scale = byte_scale
        self.roster = Roster()
        self.peers: dict[str, VirtualPeer] = {}
        self._rng = np.random.default_rng([seed, LOSS_STREAM])
        self._notify_due = False  # the waiting nodes are to be told of the changes made
        self._sending: dict[VirtualPeer, None] = {}  # peers whose uplinks may hold messages

    def join(self, node_id: str, first_round: int = 0) -> VirtualPeer:
        peer = VirtualPeer(self, node_id)
        self.peers[node_id] = peer
        self.roster.join(node_id, first_round)
        self.membership_changed()
        return peer

    def leave(self, node_id: str, after_round: int) -> None:
        """``node_id`` takes part in no round after ``after_round``; what waits on the uplinks
        for it is dropped."""
        self.roster.leave(node_id, after_round)
        self.peers[node_id].stop()
        for peer in list(self._sending):  # (not every peer: thousands may leave at once)
            peer.drop_queued(node_id)
            if not peer.uplink:
                del self._sending[peer]
        self.membership_changed()

    def membership_changed(self) -> None:
        """Tell the waiting nodes ``MEMBERSHIP_NEWS_S`` from now (every blocked ``recv``
        returns None, to re-read the membership)."""
        if not self._notify_due:
            self._notify_due = True
            self.clock.at(self.clock.now + MEMBERSHIP_NEWS_S, self._notify_all)

    def _notify_all(self) -> None:
        self._notify_due = False
        for peer in self.peers.values():
            peer.wake_waiters("notify")

    def crash(self, node_id: str, after_round: int, detect_s: float) -> None:
        """``node_id`` stops now; the others drop it from the membership ``detect_s`` later."""
        self.peers[node_id].stop()
        self.clock.stop_node(node_id)
        self.clock.at(self.clock.now + detect_s, lambda: self.leave(node_id, after_round))

    def transmit(self, sender: VirtualPeer, to: str, message: Message, nbytes: int) -> None:
        """Put a message on ``sender``'s uplink; it arrives (or is lost) in virtual time."""
        link = self.links.get((sender.node_id, to), self.link)
        now = self.clock.now
        sender.prune_uplink()
        start = _free_from(sender.uplink, now)
        transmission = Transmission(to, message, link, start, start + link.transfer_s(nbytes))
        sender.uplink.append(transmission)
        self._sending[sender] = None
        lost = self.loss > 0 and self._rng.random() < self.loss
        if to not in self.peers or lost or any(p.cuts(sender.node_id, to, now) for p in self.partitions):
            sender.messages_lost += 1
            transmission.message = None  # (it still takes its time on the uplink)
            return
        self.schedule_arrival(transmission)

    def schedule_arrival(self, transmission: Transmission) -> None:
        version = transmission.version

        def arrive() -> None:
            if transmission.version == version and transmission.message is not None:
                self.peers[transmission.to].deliver(transmission.message)

        self.clock.at(transmission.end + transmission.link.latency_s, arrive)


class VirtualPeer:
    """One node's endpoint on a :class:`VirtualNetwork` (a ``gossip.network.PeerNetwork``)."""

    def __init__(self, network: VirtualNetwork, node_id: str) -> None:
        self.network = network
        self.clock = network.clock
        self._node_id = node_id
        self.alive = True
        self.bytes_sent = 0
        self.messages_lost = 0
        self.uplink: deque[Transmission] = deque()  # what has not left the uplink yet, in order
        self._inbox: deque[Message] = deque()
        self._waiters: dict[SimThread, tuple[int, Collection[str] | None]] = {}

    @property
    def node_id(self) -> str:
        return self._node_id

    def now(self) -> float:
        return self.clock.now

    def members(self, round: int | None = None) -> frozenset[str]:
        return self.network.roster.members(round)

    def not_listening(self) -> frozenset[str]:
        return frozenset()  # every simulated node reaches every other

    def start_at_round(self, first_round: int) -> None:
        self.network.roster.start_at_round(self._node_id, first_round)
        self.network.membership_changed()

    def missed(self, node_id: str) -> None:
        """Membership is exact (crashes are detected after ``detect_s``): nothing to probe."""

    def wire_bytes(self, nbytes: int) -> int:
        return math.ceil(nbytes * self.network.byte_scale)

    def backlog(self, to: str) -> int:
        self.prune_uplink()
        return sum(t.to == to and t.message is not None for t in self.uplink)

    def stop(self) -> None:
        """The node is gone (crashed, or left after its last round): it sends and takes nothing
        more, and lets go of what its inbox held (its senders' tensors among them)."""
        self.alive = False
        self._inbox.clear()

    def drop_queued(self, to: str) -> None:
        """Drop the messages to ``to`` that have not begun to leave the uplink (it left the
        mesh); those behind them leave sooner."""
        self.prune_uplink()
        now, moved = self.clock.now, False
        kept: deque[Transmission] = deque()
        for transmission in self.uplink:
            if transmission.start > now and transmission.to == to:
                transmission.message, moved = None, True
                continue
            start = _free_from(kept, now)
            if moved and start < transmission.start:
                transmission.end -= transmission.start - start
                transmission.start = start
                transmission.version += 1
                if transmission.message is not None:
                    self.network.schedule_arrival(transmission)
            kept.append(transmission)
        self.uplink = kept

    def prune_uplink(self) -> None:
        """Forget the messages that have left the uplink."""
        while self.uplink and self.uplink[0].end <= self.clock.now:
            self.uplink.popleft()

    def send(
        self,
        to: str,
        kind: str,
        round: int,
        tensors: Sequence[np.ndarray] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        if self.clock.enter() is None or not self.alive or to not in self.network.roster.members():
            return  # (as a daemon has no contact for a node that left)
        message = Message(kind, self._node_id, round, tuple(read_only(t) for t in tensors), meta or {})
        nbytes = self.wire_bytes(sum(t.nbytes for t in tensors))
        self.bytes_sent += nbytes
        self.network.transmit(self, to, message, nbytes)

    def recv(self, timeout: float, kinds: Collection[str] | None = None) -> Message | None:
        me = self.clock.enter()
        message = self._take(kinds)
        if message is not None or me is None or timeout <= 0:
            return message
        wait_id = self.clock.begin_wait(me)
        self._waiters[me] = (wait_id, kinds)
        self.clock.at(self.clock.after(timeout), lambda: self.clock.wake(me, wait_id, "timeout"))
        woken_by = self.clock.block(me)
        self._waiters.pop(me, None)
        return self._take(kinds) if woken_by == "message" else None

    def deliver(self, message: Message) -> None:
        """A message arrives: queue it and wake a reader waiting for its kind."""
        if not self.alive:
            return
        self._inbox.append(message)
        for thread, (wait_id, kinds) in self._waiters.items():
            if kinds is None or message.kind in kinds:
                self.clock.wake(thread, wait_id, "message")
                del self._waiters[thread]
                return

    def wake_waiters(self, reason: str) -> None:
        for thread, (wait_id, _) in self._waiters.items():
            self.clock.wake(thread, wait_id, reason)
        self._waiters.clear()

    def compute(self, seconds: float) -> None:
        """A local step that takes ``seconds`` of virtual time."""
        self.clock.sleep(seconds)

    def start_background(self, name: str, target: Callable[[], None]) -> SimThread:
        """A coroutine of this node on the clock, ready to run; it stops when the node fails."""
        return self.clock.spawn(name, self._node_id, target, main=False)

    def take_pieces(self, kinds: Collection[str]) -> None:
        """Messages travel whole here (their time on a link is charged whole): nothing to change."""

    def _take(self, kinds: Collection[str] | None) -> Message | None:
        for index, message in enumerate(self._inbox):
            if kinds is None or message.kind in kinds:
                del self._inbox[index]
                return message
        return None
