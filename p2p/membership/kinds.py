"""Every kind of membership message, declared once: its name and the fields of its payload.

Every membership message carries ``updates`` (member records: the sender's own first, then news
it piggybacks; ``Member.from_wire`` checks each) and ``reply_to`` (the address answers go to).
A probe's messages add ``probe`` (the probe's id); a ping and a request to ping another member
add ``target``, the id of the member to answer (a node answers pings for its own id only).
:meth:`News.decode` checks that each field the kind needs is there with its type; a message
that fails is rejected whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PING = "ping"  # are you alive? (answered with an ack naming the same probe)
ACK = "ack"  # yes: the probe answered (or one forwarded on a ping request)
PING_REQ = "ping_req"  # ping target for me, and forward its ack
GOSSIP = "gossip"  # news, or a chunk of a table after the first
SYNC = "sync"  # my table (its first chunk): send me yours
SYNC_REPLY = "sync_reply"  # the answer to a sync: my table
ROUTE = "route"  # from a member that does not listen: a fresh route back to it

#: the fields each kind needs beside ``updates`` and ``reply_to``
NEEDS: dict[str, tuple[str, ...]] = {
    PING: ("probe", "target"),
    ACK: ("probe",),
    PING_REQ: ("probe", "target"),
    GOSSIP: (),
    SYNC: (),
    SYNC_REPLY: (),
    ROUTE: (),
}
KINDS = frozenset(NEEDS)


class PayloadError(ValueError):
    """A membership message without a field its kind needs, or with one of the wrong type."""


@dataclass(frozen=True)
class News:
    """A membership message's payload."""

    updates: list[Any]
    reply_to: str | None = None
    probe: int | None = None
    target: str | None = None

    @classmethod
    def decode(cls, kind: str, meta: Mapping[str, Any]) -> News:
        updates, reply_to = meta.get("updates"), meta.get("reply_to")
        if not isinstance(updates, list):
            raise PayloadError(f"{kind} without a list of updates")
        if reply_to is not None and type(reply_to) is not str:
            raise PayloadError(f"{kind} with a reply_to that is not an address")
        probe, target = meta.get("probe"), meta.get("target")
        needs = NEEDS[kind]
        if "probe" in needs and type(probe) is not int:
            raise PayloadError(f"{kind} without a probe id")
        if "target" in needs and type(target) is not str:
            raise PayloadError(f"{kind} without a target address")
        return cls(
            updates,
            reply_to,
            probe=probe if "probe" in needs else None,
            target=target if "target" in needs else None,
        )

    def encode(self) -> dict[str, Any]:
        """The header's meta (None fields left out)."""
        fields = dataclasses.asdict(self)
        return {name: value for name, value in fields.items() if value is not None}
