"""Serverless membership: discovery, SWIM failure detection, graceful leave, a round-aware view.

Runs on the network thread as a transport service; no node is special.

- Join: a node sends its member table (``sync``) to its bootstrap addresses (any live members;
  a DNS name counts for every address it resolves to) and merges the table that comes back,
  until each of them is a member (``p2p.membership.contacts``). With no bootstrap it is a mesh of one,
  waiting. A table goes in chunks that fit a message, whatever the mesh's size.
- Dissemination: every change is re-gossiped a few times (piggybacked on probes, and to a few
  random members every ``gossip_interval_s``); every ``push_pull_interval_s`` a node swaps its
  whole table with a random member (anti-entropy).
- Failure detection (SWIM, with memberlist's timings): every ``probe_interval_s`` a node pings
  one member (first, any the application saw fall silent: ``probe_soon``); with no ack within
  ``probe_timeout_s`` it asks ``indirect_probes`` others to ping it; with no ack by half the
  interval the member is suspected, and told so directly. A suspect that does not refute (by
  raising its incarnation) within ``suspicion_mult * max(1, log10 n)`` intervals is declared
  dead. All timers use the monotonic clock.
- Leave: the node tells every member at once, naming the last gossip round it took part in.
- Members that do not listen (``inbound://`` addresses, see ``p2p.transport.connections``): such a node
  talks only to members that listen, and every ``ROUTE_REFRESH_S`` sends each of them a
  ``route`` message, so each holds a fresh route back to it (a connection it opened). The others
  reach it along that route: probes, tables, gossip. It is never asked to ping a member that
  does not listen either, and no node dials one.
- Healing: every ``reconnect_interval_s`` a node swaps tables with one member it holds dead (a
  tombstone, kept ``tombstone_s``): after a partition heals, the halves find each other again
  (the members declared dead learn it and start new lives), with no beacon or bootstrap.

The view (``members(round)``) is round-aware so that nodes that learn of a change at slightly
different times still agree on each round's graph: a member that left after round R counts for
rounds up to R, and a late joiner counts from the round it announced. A dead member is gone at
once: a crash announces nothing.

What a member says is weighed by who says it (``p2p.membership.table``): news about a node from the
node itself (with CURVE: under the key of its record) is first-hand; everything else is
second-hand, and any news about this node that differs from what it says of itself is refuted.
A peer can add only so many new members per second; every table, queue and timer here is
bounded, so no member, trusted or not, can make a node hold more by what it sends.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from p2p.address import AddressError, parse_member_address
from p2p.membership.contacts import Contacts
from p2p.membership.kinds import (
    ACK,
    GOSSIP,
    KINDS,
    PING,
    PING_REQ,
    ROUTE,
    SYNC,
    SYNC_REPLY,
    News,
    PayloadError,
)
from p2p.membership.outbox import Outbox, table_chunks
from p2p.membership.table import Change, ConflictError, Member, MemberTable, Status, new_session, refuted
from p2p.security.ratelimit import Bucket, KeyedLimiter, QuietLog
from p2p.transport.connections import CONNECT_GRACE_S
from p2p.transport.network_thread import Transport
from p2p.wire import Message

log = logging.getLogger(__name__)

NOT_YET = 2**62  # the first round of a member that has not started taking part
MAX_UPDATES_PER_MESSAGE = 16
NEW_MEMBERS_PER_S = 256.0  # members one peer may add per second...
NEW_MEMBERS_BURST = 1024  # ...after a first burst (a table of that many, at once)
BEACON_CONTACTS_PER_S = 2.0  # beacons acted on per second, all senders together
TABLES_PER_S = 20.0  # whole tables sent per second to members heard of second-hand
MAX_FORWARDS = 64  # indirect probes this node runs for others at once
MAX_EVENTS = 10_000  # membership events kept for the run report
ROUTE_REFRESH_S = 10.0  # a node that does not listen renews its route at each member this often


@dataclass(frozen=True)
class DetectorProfile:
    """Failure-detector settings (memberlist's local / LAN / WAN profiles are the anchors)."""

    probe_interval_s: float = 1.0
    probe_timeout_s: float = 0.2
    suspicion_mult: float = 3.0
    indirect_probes: int = 3
    gossip_interval_s: float = 0.1
    gossip_fanout: int = 3
    retransmit_mult: int = 4
    push_pull_interval_s: float = 10.0
    join_retry_s: float = 0.5
    tombstone_s: float = 60.0
    reconnect_interval_s: float = 2.0

    def suspicion_timeout_s(self, members: int) -> float:
        return self.suspicion_mult * max(1.0, math.log10(max(members, 1))) * self.probe_interval_s

    def transmissions(self, members: int) -> int:
        """How many times each change is re-gossiped: enough to reach everyone w.h.p."""
        return self.retransmit_mult * math.ceil(math.log10(members + 1))


PROFILES = {
    "local": DetectorProfile(),
    "lan": DetectorProfile(
        probe_timeout_s=0.5, suspicion_mult=4, gossip_interval_s=0.2, push_pull_interval_s=30
    ),
    "wan": DetectorProfile(
        probe_interval_s=5.0,
        probe_timeout_s=3.0,
        suspicion_mult=6,
        gossip_interval_s=0.5,
        push_pull_interval_s=60,
    ),
}


@dataclass
class _Probe:
    target: str
    probe_id: int
    direct_deadline: float
    final_deadline: float
    indirect_sent: bool = False


class Membership:
    """One node's membership protocol and view.

    Args:
        transport: the node's transport (this service runs on its network thread).
        bootstrap: addresses of live members to join through (DNS names may stand for many).
        profile: failure-detector timings.
        clock: the report clock that membership events are stamped with.
        first_round: the first gossip round this node takes part in: 0 when it starts with the
            mesh; ``NOT_YET`` for a late joiner until it announces one (``start_at_round``).
        solo: with no bootstrap, whether this node starts a mesh of one (False when it waits to
            hear of others some other way, e.g. a LAN beacon).
    """

    kinds = KINDS

    def __init__(
        self,
        transport: Transport,
        bootstrap: Iterable[str] = (),
        *,
        profile: DetectorProfile = PROFILES["local"],
        clock: Callable[[], float] = time.monotonic,
        first_round: int = 0,
        solo: bool = True,
        ranks: Sequence[str] = (),
    ) -> None:
        self.profile = profile
        self._solo = solo
        self.events: list[dict[str, Any]] = []  # {"t", "observer", "node", "event"}
        self.joined = threading.Event()
        self._transport = transport
        transport.on_unreachable = self._on_unreachable
        transport.screen = self.screen
        self._contacts = Contacts(
            bootstrap,
            retry_s=profile.join_retry_s,
            max_retry_s=profile.push_pull_interval_s,
            stopped=transport.stopped,
        )
        self._clock = clock
        self._table = MemberTable()
        key = transport.curve.keys.public.decode() if transport.curve is not None else ""
        # the address is known once the transport is bound: set by the first tick (``_start``),
        # which the transport runs before anything else reaches this service
        self._me = Member(
            transport.node_id,
            "tcp://0.0.0.0:0",
            new_session(),
            0,
            Status.ALIVE,
            first_round,
            key=key,
            ranks=tuple(ranks),
        )
        self._view: tuple[Member, ...] = ()
        self._not_listening: frozenset[str] = frozenset()
        self._rng = random.Random()
        self._probe: _Probe | None = None
        self._probe_order: list[str] = []
        self._probe_ids = itertools.count(self._rng.randrange(1, 2**62))
        # my probe -> requester's address and key, its probe, expiry
        self._forwards: dict[int, tuple[str, str | None, int, float]] = {}
        self._suspicions: dict[str, float] = {}  # member id -> when it is declared dead
        self._broadcasts: dict[str, tuple[Member, int]] = {}  # member id -> news, transmissions left
        self._eligible_at: dict[str, float] = {}  # new members are probed once their connection is up
        self._hurried: dict[str, float] = {}  # member -> until when it cannot be hurried again
        self._found_dead: dict[str, int] = {}  # member id -> the life this node's own probes found dead
        self._started = False
        self._outbox = Outbox(transport)
        self._new_members = KeyedLimiter(NEW_MEMBERS_PER_S, NEW_MEMBERS_BURST)
        self._beacons = Bucket(BEACON_CONTACTS_PER_S, 2 * BEACON_CONTACTS_PER_S, time.monotonic())
        self._tables = Bucket(TABLES_PER_S, 2 * TABLES_PER_S, time.monotonic())
        self._log = QuietLog(log, per_s=10.0)
        self._next = {"probe": 0.0, "gossip": 0.0, "push_pull": 0.0, "reconnect": 0.0}
        self._routes_renewed: dict[str, float] = {}  # (not listening) member id -> last route sent

    # -- any thread --------------------------------------------------------------------------

    def members(self, round: int | None = None) -> frozenset[str]:
        """Member ids, this node included: now, or in gossip ``round``."""
        return members_in_round(self._view, round)

    @property
    def not_listening(self) -> frozenset[str]:
        """The members (gone ones still in the view included) that accept no connection."""
        return self._not_listening

    @property
    def view(self) -> tuple[Member, ...]:
        """Every member this node knows (this node first), as of the last change."""
        return self._view

    def peer_states(self) -> dict[str, int]:
        """How many other members this node knows in each state (alive, suspect, dead, left)."""
        counts = dict.fromkeys((status.value for status in Status), 0)
        for member in self._view[1:]:  # the view starts with this node
            counts[member.status.value] += 1
        return counts

    def contact(self, node_id: str) -> tuple[str, str] | None:
        """The address and CURVE key ("" without CURVE) of live member ``node_id``."""
        for member in self._view:
            if member.id == node_id and member.status.live:
                return member.address, member.key
        return None

    @property
    def join_error(self) -> str:
        """Why the bootstrap names did not resolve, if they did not."""
        return self._contacts.error

    def leave(self, after_round: int = -1) -> None:
        """Tell every member this node takes part in no gossip round after ``after_round``."""
        _check_round(after_round, "after_round", -1)
        self._transport.call_soon(lambda: self._say_me(status=Status.LEFT, last_round=after_round))

    def start_at_round(self, first_round: int) -> None:
        """Announce that this node (a late joiner) takes part in gossip rounds >= first_round;
        on return its own view has it (its very next round counts it among the members)."""
        _check_round(first_round, "first_round", 0)
        self._transport.call(lambda: self._say_me(first_round=first_round))

    def alone(self) -> bool:
        """No other live member known (network thread)."""
        return not self._table.live()

    def add_contact(self, node_id: str, address: str, key: str = "") -> None:
        """A node heard of some other way (a beacon): swap tables with it unless it is a live
        member (network thread). This joins lone nodes and merges meshes that started apart.
        Nothing in it binds an address to a key or a member: with CURVE the table exchange goes
        over a connection of its own, with ``key`` only if that key is trusted (else not at
        all), and a member's record comes only from the exchange. At most
        ``BEACON_CONTACTS_PER_S`` contacts are acted on per second."""
        known = self._table.members.get(node_id)
        if node_id == self._me.id or (known is not None and known.status.live):
            return
        curve = self._transport.curve
        if curve is not None and not (key and curve.trusted.allows(key.encode())):
            self._transport.stats.drop("beacon_key_not_trusted")
        elif not self._beacons.take(time.monotonic()):
            self._transport.stats.drop("beacon_rate")
        else:
            self._send_table(address, SYNC, key=key or None, member=False)

    def probe_soon(self, node_id: str) -> None:
        """Probe ``node_id`` next (the application saw it fall silent); at most once per
        interval per member, so hints cannot flood the network."""
        self._transport.call_soon(lambda: self._hurry(node_id))

    # -- network thread: the service interface ------------------------------------------------

    def on_message(self, message: Message) -> None:
        peer = self._transport.peer_name(message)
        try:
            news = News.decode(message.kind, message.meta)
        except PayloadError as exc:
            self._transport.reject(peer, "bad_membership", str(exc))
            return
        self._merge(message, news.updates, peer)
        if message.kind == PING:
            if news.target != self._me.id:  # only a node itself says it is alive
                self._transport.stats.drop("ping_not_for_me")
            else:
                self._reply(message, news, ACK, News(self._piggyback(), probe=news.probe), peer)
        elif message.kind == ACK:
            assert news.probe is not None
            self._on_ack(news.probe)
        elif message.kind == PING_REQ:
            self._on_ping_request(message, news, peer)
        elif message.kind == SYNC:
            address = self._reply_address(message, news, peer)
            if address is not None:
                self._send_table(address, SYNC_REPLY, key=message.key or None, member=False)

    def screen(self, message: Message) -> bool:
        """The transport's check of a message for the inbox (see :func:`from_member`)."""
        return from_member(self._transport, self._table.members.get(message.sender), message)

    def on_tick(self, now: float) -> float:
        if not self._started:
            self._start(now)
        self._outbox.send_due(now)
        live = {m.address for m in self._table.live()}
        for address in self._contacts.due(now, live, self._me.address):
            self._transport.disconnect(address)  # a refused CURVE handshake is not retried by ZeroMQ
            self._send_table(address, SYNC, key=None, member=False)
        if self._me.status == Status.LEFT:
            return now + 1.0
        self._check_probe(now)
        if now >= self._next["probe"]:
            self._start_probe(now)
            self._next["probe"] = now + self.profile.probe_interval_s
        self._declare_dead(now)
        if now >= self._next["gossip"]:
            self._gossip()
            self._next["gossip"] = now + self.profile.gossip_interval_s
        if now >= self._next["push_pull"]:
            self._push_pull()
            self._next["push_pull"] = now + self.profile.push_pull_interval_s
        if now >= self._next["reconnect"]:
            self._reconnect()
            self._next["reconnect"] = now + self.profile.reconnect_interval_s
        if not self._me.reachable:
            self._renew_routes(now)
        self._expire(now)
        wake = [*self._next.values(), now + 1.0, *self._suspicions.values()]
        wake += [t for t in (self._contacts.next_try(), self._outbox.next_due()) if t is not None]
        if self._probe is not None:
            wake.append(
                self._probe.final_deadline if self._probe.indirect_sent else self._probe.direct_deadline
            )
        return min(wake)

    # -- joining ------------------------------------------------------------------------------

    def _start(self, now: float) -> None:
        self._started = True
        self._me = replace(self._me, address=self._transport.address)
        self._table.own(self._me)
        if not self._contacts.names and self._solo:
            self.joined.set()  # a mesh of one, until someone joins it
        self._publish()

    def _push_pull(self) -> None:
        live = self._reachable_live()
        if live:
            self._send_table_to(self._rng.choice(live), SYNC)

    def _reconnect(self) -> None:
        """Swap tables with a member held dead, over a fresh connection (the old one may be
        stuck behind what was queued while the network was split); one that does not listen
        reconnects itself. Only a death this node's own probes found closes a connection: news
        of one from others (true or forged) does not cut a link that works."""
        dead = [m for m in self._table.members.values() if m.status == Status.DEAD and m.reachable]
        if dead:
            member = self._rng.choice(dead)
            found = self._found_dead.get(member.id) == member.session
            if found and self._table.holder(member.address) is None:
                self._transport.disconnect(member.address)
            self._send_table(member.address, SYNC, key=member.key or None, member=False)

    # -- probing ------------------------------------------------------------------------------

    def _start_probe(self, now: float) -> None:
        target = self._next_target(now)
        if target is None:
            return
        probe_id = next(self._probe_ids)
        self._probe = _Probe(
            target.id,
            probe_id,
            direct_deadline=now + self.profile.probe_timeout_s,
            final_deadline=now + self.profile.probe_interval_s / 2,
        )
        self._send_to(target, PING, News(self._piggyback(), probe=probe_id, target=target.id))

    def _can_reach(self, member: Member) -> bool:
        """Whether this node can send to ``member``: one that does not listen (see the module
        docstring) reaches only members that do."""
        return member.reachable or self._me.reachable

    def _reachable_live(self) -> list[Member]:
        return [m for m in self._table.live() if self._can_reach(m)]

    def _renew_routes(self, now: float) -> None:
        """Keep a fresh route back to this node (it does not listen) at every member that listens."""
        live = {m.id: m for m in self._table.live() if m.reachable}
        for node_id in self._routes_renewed.keys() - live.keys():
            del self._routes_renewed[node_id]
        for node_id, member in live.items():
            if now - self._routes_renewed.get(node_id, -math.inf) >= ROUTE_REFRESH_S:
                self._routes_renewed[node_id] = now
                self._send_to(member, ROUTE, News([]))

    def _next_target(self, now: float) -> Member | None:
        """Round-robin over the live members in a random order, reshuffled every pass."""
        for _ in range(2):
            while self._probe_order:
                member = self._table.members.get(self._probe_order.pop())
                if member is not None and member.status.live and self._eligible_at.get(member.id, 0) <= now:
                    return member
            self._probe_order = [m.id for m in self._reachable_live()]
            self._rng.shuffle(self._probe_order)
        return None

    def _on_unreachable(self, address: str) -> None:
        """The transport could not queue a message to ``address`` (its connection is gone):
        probe the member there now."""
        for member in self._table.live():
            if member.address == address:
                self._hurry(member.id)

    def _hurry(self, node_id: str) -> None:
        now = time.monotonic()
        member = self._table.members.get(node_id)
        busy = self._probe is not None and self._probe.target == node_id
        if member is None or member.status != Status.ALIVE or busy or self._hurried.get(node_id, 0.0) > now:
            return
        self._hurried[node_id] = now + self.profile.probe_interval_s
        self._probe_order.append(node_id)  # popped next
        if self._probe is None:
            self._next["probe"] = now
            self._transport.tick_within(0)

    def _check_probe(self, now: float) -> None:
        probe = self._probe
        if probe is None:
            return
        target = self._table.members.get(probe.target)
        if target is None or not target.status.live:
            self._probe = None
        elif not probe.indirect_sent and now >= probe.direct_deadline:
            probe.indirect_sent = True
            # a member that does not listen is pinged only by members that do
            helpers = [
                m
                for m in self._reachable_live()
                if m.id != probe.target and (m.reachable or target.reachable)
            ]
            for helper in self._rng.sample(helpers, min(self.profile.indirect_probes, len(helpers))):
                self._send_to(helper, PING_REQ, News([], probe=probe.probe_id, target=target.id))
        elif now >= probe.final_deadline:
            self._probe = None
            if target.status == Status.ALIVE:
                self._note(replace(target, status=Status.SUSPECT), now)

    def _on_ack(self, probe_id: int) -> None:
        if self._probe is not None and probe_id == self._probe.probe_id:
            self._probe = None  # answered
        elif probe_id in self._forwards:
            requester, key, their_probe, _ = self._forwards.pop(probe_id)
            self._send(requester, ACK, News([], probe=their_probe), key=key, member=False)

    def _on_ping_request(self, message: Message, news: News, peer: str) -> None:
        """Ping a member (named by its id) for another one; only a live member, and only so many
        at once."""
        their_probe = news.probe
        assert their_probe is not None
        target = self._table.members.get(str(news.target))
        target = target if target is not None and target.status.live else None
        requester = self._reply_address(message, news, peer)
        if requester is None:  # (rejected: no address to answer)
            return
        if target is None or not self._can_reach(target):  # not (or no longer) a live member
            self._transport.stats.drop("ping_req_not_a_member")  # here, or not one we can reach
        elif len(self._forwards) >= MAX_FORWARDS:
            self._transport.stats.drop("ping_req_backlog")
        else:
            self._forward_probe(their_probe, requester, message.key or None, target)

    def _forward_probe(self, their_probe: int, requester: str, key: str | None, target: Member) -> None:
        probe_id = next(self._probe_ids)
        expiry = time.monotonic() + self.profile.probe_interval_s
        self._forwards[probe_id] = (requester, key, their_probe, expiry)
        self._send_to(target, PING, News(self._piggyback(), probe=probe_id, target=target.id))

    def _declare_dead(self, now: float) -> None:
        for node_id, deadline in list(self._suspicions.items()):
            member = self._table.members.get(node_id)
            if member is None or member.status != Status.SUSPECT:
                del self._suspicions[node_id]
            elif now >= deadline:
                del self._suspicions[node_id]
                self._found_dead[member.id] = member.session
                self._note(replace(member, status=Status.DEAD), now)

    # -- news ---------------------------------------------------------------------------------

    def _merge(self, message: Message, updates: list[Any], peer: str) -> None:
        """Apply a message's updates, first-hand or second-hand (see the module docstring)."""
        now = time.monotonic()
        for raw in updates:
            try:
                news = Member.from_wire(raw)
            except ValueError as exc:
                self._transport.reject(peer, "bad_membership", str(exc))
                continue
            first_hand = news.id == message.sender
            curve = self._transport.curve
            if first_hand and curve is not None and news.key != message.key:
                self._transport.reject(peer, "key_mismatch", f"{news.id}'s record names another key")
            elif (curve is None and news.key) or (
                curve is not None and not (news.key and curve.trusted.allows(news.key.encode()))
            ):
                self._transport.stats.drop("member_key_not_usable")  # a member we could not talk to
            elif news.id == self._me.id:
                answer = refuted(self._me, news)
                if answer is not None:
                    self._announce(answer)
            elif news.id not in self._table.members and not self._new_members.allow(peer):
                self._transport.stats.drop("member_rate")
            else:
                try:
                    self._note(news, now, first_hand=first_hand)
                except ConflictError as exc:
                    self._transport.reject(peer, "member_conflict", str(exc))
        if self._table.live():  # joined: said once the whole message is in the view (a joiner
            self.joined.set()  # decides from it whom to take the state of)

    def _note(self, news: Member, now: float, *, first_hand: bool = True) -> None:
        """Apply news to the table; on a change, record it, act on it and pass it on."""
        change = self._table.apply(news, now, first_hand=first_hand)
        if change is None:
            return
        if change.event is not None:
            self._record(change)
        member = change.member
        if change.event == "suspected":
            timeout = self.profile.suspicion_timeout_s(len(self._table.live()) + 1)
            self._suspicions.setdefault(member.id, now + timeout)
        else:
            self._suspicions.pop(member.id, None)
        if change.event == "joined":
            self._eligible_at[member.id] = now + CONNECT_GRACE_S
            # whoever learns of a member makes sure it learns of them: our table, or, beyond
            # TABLES_PER_S for members heard of second-hand (a flood of names would cost a table
            # per name), our own record
            if first_hand or self._tables.take(now):
                self._send_table_to(member, SYNC)
            else:
                self._send_to(member, GOSSIP, News([]))
        if change.event in ("suspected", "dead"):  # so it can refute, or rejoin, as soon as it can
            self._send_to(member, GOSSIP, News([member.to_wire()]))
        self._queue(member)
        self._publish()

    def _record(self, change: Change) -> None:
        node, event = change.member.id, str(change.event)
        if len(self.events) < MAX_EVENTS:
            self.events.append(
                {"t": round(self._clock(), 3), "observer": self._me.id, "node": node, "event": event}
            )
        self._log.log(logging.INFO, f"{event} {node}", "%s: %s is %s", self._me.id, node, event)

    def _say_me(self, **changes: Any) -> None:
        self._announce(replace(self._me, incarnation=self._me.incarnation + 1, **changes))

    def _announce(self, me: Member) -> None:
        """Adopt a new record of ourselves and tell every member at once."""
        self._me = me
        self._publish()
        for member in self._reachable_live():
            self._send_to(member, GOSSIP, News([me.to_wire()]))
        self._queue(me)

    def _queue(self, member: Member) -> None:
        self._broadcasts[member.id] = (member, self.profile.transmissions(len(self._table.live()) + 1))

    def _piggyback(self) -> list[Any]:
        """Up to MAX_UPDATES_PER_MESSAGE pending changes, least-sent first."""
        chosen = sorted(self._broadcasts.items(), key=lambda item: -item[1][1])[:MAX_UPDATES_PER_MESSAGE]
        for node_id, (member, left) in chosen:
            if left <= 1:
                del self._broadcasts[node_id]
            else:
                self._broadcasts[node_id] = (member, left - 1)
        return [member.to_wire() for _, (member, _) in chosen]

    def _gossip(self) -> None:
        live = self._reachable_live()
        if not self._broadcasts or not live:
            return
        for member in self._rng.sample(live, min(self.profile.gossip_fanout, len(live))):
            self._send_to(member, GOSSIP, News(self._piggyback()))

    def _publish(self) -> None:
        """Refresh the view other threads read, and wake anyone waiting on a round."""
        self._view = (self._me, *self._table.members.values())
        self._not_listening = frozenset(m.id for m in self._view if not m.reachable)
        self._transport.notify()

    def _expire(self, now: float) -> None:
        for probe_id, (*_, expiry) in list(self._forwards.items()):
            if now > expiry:
                del self._forwards[probe_id]
        for node_id in [n for n, until in self._hurried.items() if until <= now]:
            del self._hurried[node_id]
        for member in self._table.forget_ended(now, self.profile.tombstone_s):
            self._eligible_at.pop(member.id, None)
            self._found_dead.pop(member.id, None)
            if member.address not in {m.address for m in self._table.live()}:
                self._transport.disconnect(member.address)
            self._publish()

    # -- sending ------------------------------------------------------------------------------

    def _send_to(self, member: Member, kind: str, news: News) -> None:
        if self._can_reach(member):
            self._send(member.address, kind, news, key=member.key or None, member=True)

    def _send(self, address: str, kind: str, news: News, *, key: str | None, member: bool) -> None:
        """Send (once the connection is up). Every message carries our own record, so any
        contact makes us known to the receiver."""
        ours = replace(news, updates=[self._me.to_wire(), *news.updates], reply_to=self._transport.address)
        self._outbox.send(time.monotonic(), address, kind, ours.encode(), key=key, member=member)

    def _send_table_to(self, member: Member, kind: str) -> None:
        if self._can_reach(member):
            self._send_table(member.address, kind, key=member.key or None, member=True)

    def _send_table(self, address: str, kind: str, *, key: str | None, member: bool) -> None:
        """Our whole table: ``kind`` (sync or sync_reply) with the first chunk, gossip with
        the others when it does not fit one message."""
        chunks = table_chunks([m.to_wire() for m in self._table.members.values()])
        for i, chunk in enumerate(chunks):
            self._send(address, kind if i == 0 else GOSSIP, News(chunk), key=key, member=member)

    def _reply_address(self, message: Message, news: News, peer: str) -> str | None:
        try:
            return parse_member_address(str(news.reply_to), message.sender)
        except AddressError as exc:
            self._transport.reject(peer, "bad_membership", str(exc))
            return None

    def _reply(self, message: Message, news: News, kind: str, answer: News, peer: str) -> None:
        address = self._reply_address(message, news, peer)
        if address is not None:
            self._send(address, kind, answer, key=message.key or None, member=False)


def from_member(transport: Transport, member: Member | None, message: Message) -> bool:
    """Whether ``message``, bound for the inbox, comes from ``member`` (its sender's record;
    None: not known yet, so dropped: it is nobody's neighbour here) with the key of that record
    (so a trusted key cannot speak as another member); what fails is counted."""
    if member is None:
        transport.stats.drop("unknown_sender")
        return False
    if member.key != message.key:
        transport.reject(transport.peer_name(message), "key_mismatch", member.id)
        return False
    return True


def members_in_round(view: Iterable[Member], round: int | None) -> frozenset[str]:
    """The ids of ``view``'s members now (``round`` None), or in gossip ``round``: a node that
    left after round R is still a member of rounds up to R, so views agree on each round."""
    if round is None:
        return frozenset(m.id for m in view if m.status.live)
    return frozenset(
        m.id
        for m in view
        if m.first_round <= round and (m.status.live or (m.status == Status.LEFT and round <= m.last_round))
    )


def _check_round(value: int, name: str, lowest: int) -> None:
    """A round this node announces must be one every member can read (a bad one, adopted into
    this node's own record, would spoil every message it sends)."""
    if not lowest <= value < NOT_YET:
        raise ValueError(f"{name} must be in {lowest}..{NOT_YET - 1}, got {value}")
