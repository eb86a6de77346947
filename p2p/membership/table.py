"""The member table: what one node believes about every other, and how news is merged.

A member is one life of a node: its id plus the ``session`` its process drew at start, so a
restarted node is a new life and old news about the previous one cannot touch it. Within a
life, SWIM's incarnation numbers order the news: only the member itself raises its
incarnation (to refute a suspicion), ``suspect`` beats ``alive`` of the same incarnation,
``alive`` needs a higher one to clear a suspicion or a false death, and ``left`` is final.
Dead and departed lives stay as tombstones for a while, so stale gossip cannot resurrect them.

News comes first-hand (a node's own record, in a message it sent) or second-hand (relayed, or
a verdict of another node's failure detector). Second-hand news cannot say a node left (only
the node itself can), cannot replace a live member's life with another, and cannot raise a
member's incarnation by more than one; no news may change the address or key of a life. So a
member, even a trusted one, cannot take over or evict another by what it gossips: whatever it
says second-hand the subject refutes (``refuted``), and its first-hand news is only about itself.
An address and a CURVE key belong to one live id at a time: news of another id at a live
member's address, or with its key, is a conflict unless that member itself says it (first-hand,
with the key it holds; a node restarted under a new id), so nobody can add phantoms that a live
member's process answers for. When it does, the id that held them is dead from then on: a
phantom put at a dead member's address ends when that member comes back, not when it is
probed out.
"""

from __future__ import annotations

import enum
import re
import secrets
from dataclasses import dataclass, replace
from typing import Any

from p2p.address import AddressError, check_node_id, inbound_id, parse_endpoint, parse_member_address

_U63 = 2**63 - 1
MAX_ADDRESS_CHARS = 300
MAX_LOCAL_RANKS = 64
MAX_INCARNATION = 2**32  # a life raises its incarnation by one or two per refutation: far below
_Z85_KEY = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}\Z")


class Status(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"

    @property
    def live(self) -> bool:
        """Alive and suspected members are still members: they still train and average."""
        return self in (Status.ALIVE, Status.SUSPECT)


@dataclass(frozen=True)
class Member:
    id: str
    address: str
    session: int
    incarnation: int
    status: Status
    first_round: int = 0  # a member of gossip rounds >= first_round (a late joiner's start)
    last_round: int = -1  # once left: a member of rounds <= last_round (-1: of none)
    key: str = ""  # its CURVE public key (z85), which a node dialing it must know; "" if insecure
    # a machine of several local ranks: the data addresses of ranks 1, 2... (``address`` is
    # rank 0's, which also runs membership); each rank gossips its slice with the same rank
    ranks: tuple[str, ...] = ()

    def to_wire(self) -> list[Any]:
        wire = [
            self.id,
            self.address,
            self.session,
            self.incarnation,
            self.status.value,
            self.first_round,
            self.last_round,
            self.key,
        ]
        return [*wire, list(self.ranks)] if self.ranks else wire

    @property
    def reachable(self) -> bool:
        """Whether it accepts connections (else it is reached over those it opens: ``--no-listen``)."""
        return inbound_id(self.address) is None

    @property
    def endpoints(self) -> tuple[str, str, tuple[str, ...]]:
        """What a life cannot change: where it is reached and with what key."""
        return self.address, self.key, self.ranks

    @classmethod
    def from_wire(cls, raw: Any) -> Member:
        """Validate one update from the network; raises ValueError on anything malformed."""
        if not isinstance(raw, list) or len(raw) not in (8, 9):
            raise ValueError("a member update is a list of 8 fields (9 with local ranks)")
        ranks = _rank_addresses(raw[8]) if len(raw) == 9 else ()
        node_id, address, session, incarnation, status, first_round, last_round, key = raw[:8]
        if not isinstance(key, str) or not (key == "" or _Z85_KEY.match(key)):
            raise ValueError("member key must be a 40-character z85 CURVE key or empty")
        if not isinstance(node_id, str) or not isinstance(address, str) or len(address) > MAX_ADDRESS_CHARS:
            raise ValueError(f"member id and address must be strings (addresses of <= {MAX_ADDRESS_CHARS})")
        try:
            check_node_id(node_id)
            address = parse_member_address(address, node_id)
        except AddressError as exc:
            raise ValueError(str(exc)) from None
        if type(session) is not int or not 0 <= session <= _U63:
            raise ValueError("session must be a non-negative 63-bit int")
        if type(incarnation) is not int or not 0 <= incarnation <= MAX_INCARNATION:
            raise ValueError(f"incarnation must be an int in 0..{MAX_INCARNATION}")
        for value in (first_round, last_round):
            if type(value) is not int or not -1 <= value <= _U63:
                raise ValueError("rounds must be ints >= -1")
        return cls(
            node_id, address, session, incarnation, Status(status), first_round, last_round, key, ranks
        )


def _rank_addresses(raw: Any) -> tuple[str, ...]:
    """The data addresses of a machine's ranks 1, 2... from the wire; raises ValueError."""
    if not isinstance(raw, list) or not 1 <= len(raw) < MAX_LOCAL_RANKS:
        raise ValueError(f"local rank addresses must be a list of 1 to {MAX_LOCAL_RANKS - 1}")
    if not all(isinstance(a, str) and len(a) <= MAX_ADDRESS_CHARS for a in raw):
        raise ValueError(f"local rank addresses must be strings of <= {MAX_ADDRESS_CHARS} characters")
    try:
        return tuple(parse_endpoint(a) for a in raw)
    except AddressError as exc:
        raise ValueError(str(exc)) from None


@dataclass(frozen=True)
class Change:
    """A member whose record changed; ``event`` names a change of status, if there was one."""

    member: Member
    event: str | None  # joined | suspected | alive | dead | left | None (e.g. a new first round)


class ConflictError(ValueError):
    """News that gives a known life another address or key: never true, so counted."""


class MemberTable:
    """Every known life but this node's own; single-threaded (the network thread owns it)."""

    def __init__(self) -> None:
        self.members: dict[str, Member] = {}
        self._ended: dict[tuple[str, int], float] = {}  # (id, session) of dead or left lives -> when
        self._holders: dict[str, Member] = {}  # claim (address or key) -> the live life holding it
        self._own: frozenset[str] = frozenset()  # this node's addresses: nobody else's, ever
        self._shared_key = ""  # this node's key: a mesh with one key pair shares it, so no claim

    def own(self, me: Member) -> None:
        """Reserve this node's address and ranks' addresses (its key is not a claim: a mesh that
        uses one key pair for every node shares it)."""
        self._shared_key = me.key
        self._own = frozenset(self._claims(me))

    def apply(self, news: Member, now: float, *, first_hand: bool = True) -> Change | None:
        """Merge one piece of news (``first_hand``: from the member itself, or this node's own
        verdict); returns the change it makes, if any. Raises ConflictError for news that gives a
        known life another address or key."""
        current = self.members.get(news.id)
        if (news.id, news.session) in self._ended:
            return None  # a life that already ended: nothing can bring it back
        if current is not None and current.session == news.session and news.endpoints != current.endpoints:
            raise ConflictError(
                f"{news.id} is at {current.address}, not {news.address}, or has other keys or ranks"
            )
        displaced = self._check_claims(news, first_hand) if news.status.live else []
        if not first_hand and not _believable(news, current):
            return None
        if current is not None and current.session != news.session:
            if not news.status.live:
                self._end(news, now)
                return None
            self._end(current, now)  # a new life (a restart) replaces the old one
            current = None
        if current is None:
            if not news.status.live:
                self._end(news, now)
                return None
            self._take_over(news, displaced, now)
            return Change(news, "joined")
        if not _supersedes(news, current):
            return None
        self._take_over(news, displaced, now)
        if not news.status.live:
            self._end(news, now)
        if news.status == current.status:
            return Change(news, None)
        event = {Status.ALIVE: "alive", Status.SUSPECT: "suspected"}.get(news.status, news.status.value)
        return Change(news, event)

    def live(self) -> list[Member]:
        return [m for m in self.members.values() if m.status.live]

    def forget_ended(self, now: float, after_s: float) -> list[Member]:
        """Drop dead and left members (and their tombstones) older than ``after_s``."""
        expired = {key for key, when in self._ended.items() if now - when > after_s}
        for key in expired:
            del self._ended[key]
        gone = [m for m in self.members.values() if (m.id, m.session) in expired]
        for member in gone:
            del self.members[member.id]
        return gone

    def holder(self, address: str) -> Member | None:
        """The live member at ``address``, if any."""
        return self._holders.get(address)

    def _check_claims(self, news: Member, first_hand: bool) -> list[Member]:
        """Raise ConflictError if another live id holds ``news``' address or key, unless that
        holder itself says it (first-hand news under the holder's own key): those holders,
        which ``news`` displaces."""
        displaced = []
        for claim in self._claims(news):
            if claim in self._own:
                raise ConflictError(f"{news.id} claims {claim}, which is this node's")
            holder = self._holders.get(claim)
            if holder is None or holder.id == news.id:
                continue
            if not (first_hand and holder.key == news.key):
                raise ConflictError(f"{news.id} claims {claim}, which live member {holder.id} holds")
            displaced.append(holder)
        return displaced

    def _take_over(self, news: Member, displaced: list[Member], now: float) -> None:
        """Store ``news``; the ids whose address or key it took are dead (one node, one id)."""
        for holder in displaced:
            if self.members.get(holder.id) is holder:
                self._put(replace(holder, status=Status.DEAD))
                self._end(holder, now)
        self._put(news)

    def _put(self, member: Member) -> None:
        """Store ``member`` and move the claims of its id to its new record (none once it ends)."""
        old = self.members.get(member.id)
        if old is not None:
            for claim in self._claims(old):
                if self._holders.get(claim) is old:
                    del self._holders[claim]
        self.members[member.id] = member
        if member.status.live:
            for claim in self._claims(member):
                self._holders[claim] = member

    def _claims(self, member: Member) -> list[str]:
        """What only one live id may hold: its addresses, and its key unless it is shared."""
        key = [f"key {member.key}"] if member.key and member.key != self._shared_key else []
        return [member.address, *member.ranks, *key]

    def _end(self, member: Member, now: float) -> None:
        self._ended.setdefault((member.id, member.session), now)


def _believable(news: Member, current: Member | None) -> bool:
    """Whether second-hand news may be applied at all."""
    if news.status == Status.LEFT:
        return False  # only the member itself says it leaves
    if current is None or not current.status.live:
        return True
    return news.session == current.session and news.incarnation <= current.incarnation + 1


def _supersedes(news: Member, current: Member) -> bool:
    """SWIM's precedence within one life."""
    if current.status == Status.LEFT:
        return False
    if news.status == Status.LEFT:
        return True
    if news.status == Status.DEAD:
        return current.status != Status.DEAD and news.incarnation >= current.incarnation
    if news.status == Status.SUSPECT:
        if current.status == Status.ALIVE:
            return news.incarnation >= current.incarnation
        return news.incarnation > current.incarnation
    return news.incarnation > current.incarnation  # alive


def refuted(me: Member, news: Member) -> Member | None:
    """This node's answer to news about its life that is not what it says of itself, else None.

    A death cannot be refuted (the life is a tombstone everywhere): the node starts a new life,
    which the others see as a rejoin. Anything else (a suspicion, a departure, another address,
    key or round, a higher incarnation) is refuted with its own record at an incarnation above
    the news', at most two above its own (others take second-hand news at most one ahead);
    should that pass MAX_INCARNATION, with a new life. News of an older life, or older than
    this node's incarnation, needs no answer.
    """
    if me.status == Status.LEFT or news.session != me.session:
        return None
    if news.status == Status.DEAD:
        return replace(me, session=new_session(), incarnation=0)
    if news.incarnation < me.incarnation or news == me:
        return None
    incarnation = max(me.incarnation, min(news.incarnation, me.incarnation + 1)) + 1
    if incarnation > MAX_INCARNATION:
        return replace(me, session=new_session(), incarnation=0)
    return replace(me, incarnation=incarnation)


def new_session() -> int:
    return secrets.randbits(63)
