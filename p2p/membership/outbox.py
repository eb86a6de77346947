"""How membership messages leave: after a new connection is up, and tables in chunks.

A new ZeroMQ connection drops what is sent before its handshake completes, so a message to an
address not dialed yet waits (at most ``MAX_WAITING`` of them; the oldest goes first) until the
connection can take it, and then still for a handshake that a loaded peer has slowed (sent
``patient``, see ``p2p.transport.connections``). A member table goes as several messages when it
does not fit one: the decoder takes at most 512 items per array and 64 KiB per header, whatever
the mesh's size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from p2p.transport.network_thread import Transport

MAX_WAITING = 1024
TABLE_CHUNK_BYTES = 32 << 10
TABLE_CHUNK_RECORDS = 255  # and the sender's own record in front: within the decoder's arrays


@dataclass(frozen=True)
class _Waiting:
    at: float
    address: str
    kind: str
    meta: dict[str, Any]
    key: str | None
    member: bool


class Outbox:
    """Sends of one membership service (network thread)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._waiting: deque[_Waiting] = deque()

    def send(
        self, now: float, address: str, kind: str, meta: dict[str, Any], *, key: str | None, member: bool
    ) -> None:
        """Send now, or once the connection to ``address`` (with ``key``) is up."""
        ready_at = self._transport.ready_at(address, key, member=member)
        if now >= ready_at:
            self._transport.send(address, kind, 0, meta=meta, key=key, member=member, patient=True)
            return
        if len(self._waiting) >= MAX_WAITING:
            self._waiting.popleft()
            self._transport.stats.drop("membership_backlog")
        self._waiting.append(_Waiting(ready_at, address, kind, meta, key, member))
        self._transport.tick_within(ready_at - now)

    def send_due(self, now: float) -> None:
        due = [w for w in self._waiting if w.at <= now]
        if due:
            self._waiting = deque(w for w in self._waiting if w.at > now)
        for w in due:
            self._transport.send(w.address, w.kind, 0, meta=w.meta, key=w.key, member=w.member, patient=True)

    def next_due(self) -> float | None:
        return min((w.at for w in self._waiting), default=None)


def table_chunks(records: Sequence[list[Any]]) -> list[list[list[Any]]]:
    """``records`` split into lists that each fit one message (at least one list)."""
    chunks: list[list[list[Any]]] = [[]]
    size = 0
    for record in records:
        nbytes = len(msgpack.packb(record))
        if chunks[-1] and (size + nbytes > TABLE_CHUNK_BYTES or len(chunks[-1]) >= TABLE_CHUNK_RECORDS):
            chunks.append([])
            size = 0
        chunks[-1].append(record)
        size += nbytes
    return chunks
