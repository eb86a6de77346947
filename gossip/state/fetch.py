"""A newcomer's side of state transfer: pulling a state from one or more sources at once.

Each source is a lane: its manifest first, then up to ``window`` chunks requested and not yet
received; every chunk that arrives frees a credit for the next request, so the transfer runs as
fast as the link and the sources allow and no source queues more than the window. The state's
counters (steps, round, rounds_per_s) are what the sources agree on
(``gossip.state.manifest.agreed_counters``), never what one says: the fetch waits for the
manifests of more than half of the sources not caught lying (a bad manifest or chunk), so a
source that answers first and fast cannot set the joiner's round alone while honest ones are
slower. Until those manifests are in, a source is asked for at most its share of the chunks
(the state's count over the quorum), so they spread over the sources instead of all going to
the first to answer, while the first ones flow at once. A source whose round is far from the
agreed one is named in ``outvoted``. Chunks still owed by a lane that has sent nothing for
``retry_s`` are asked of the lanes that move (or of it again); a lane silent for
``patience_s``, or whose answers are bad, is dropped. The transfer fails only when no lane is
left, or after ``timeout``.
"""

from __future__ import annotations

import math
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gossip.messages import (
    STATE_MANIFEST,
    STATE_REQUEST,
    PayloadError,
    StateChunk,
    StateManifest,
    StateRequest,
)
from gossip.network import Envelope, PeerNetwork
from gossip.state.manifest import (
    ALIGN,
    CHUNK_BYTES,
    JOINER_KINDS,
    MAX_CHUNK_BYTES,
    MAX_WINDOW,
    MIN_CHUNK_BYTES,
    WINDOW,
    Assembly,
    Manifest,
    Snapshot,
    StateSink,
    StateTransferError,
    agreed_counters,
    far_from,
)

RETRY_S = 3.0  # a lane that owes chunks and sent nothing this long is asked for them again
# a manifest request that brought nothing this soon is sent again, up to QUICK_ASKS times, then
# every retry_s: a request sent before the connection is up waits for it only so long (2 s,
# ``p2p.transport.connections.HANDSHAKE_S``), which a loaded machine's handshake can outlast
REASK_S = 0.5
QUICK_ASKS = 8
POLL_S = 0.25  # how often a fetch looks whether it was cancelled


@dataclass
class TransferStats:
    """How a transfer went: what a run report and a benchmark show."""

    bytes: int = 0
    seconds: float = 0.0
    sources: list[str] = field(default_factory=list)  # the members asked
    manifest_s: dict[str, float] = field(default_factory=dict)  # when each one's manifest came
    chunks: dict[str, int] = field(default_factory=dict)  # received from each source
    reasked: int = 0  # chunks asked again after their lane stalled
    dropped_sources: dict[str, str] = field(default_factory=dict)  # source -> why
    outvoted: dict[str, str] = field(default_factory=dict)  # source -> how its counters were far off

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)

    def summary(self) -> dict[str, Any]:
        """The run report's ``state_transfer`` of a node that joined."""
        return {
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "mb_per_s": round(self.mb_per_s, 1),
            "sources": list(self.sources),
            "manifest_s": dict(self.manifest_s),
            "chunks": dict(self.chunks),
            "reasked": self.reasked,
            "dropped_sources": dict(self.dropped_sources),
            "outvoted": dict(self.outvoted),
        }


@dataclass
class _Lane:
    source: str
    heard: float  # when it last sent anything, or was asked for chunks while owing none: its stall clock
    last_message: float  # when it last sent anything (or the fetch began): its patience clock
    manifest_due: float  # when to ask for its manifest (again); inf once it arrived
    asks: int = 0
    stalls: int = 0  # times it owed chunks and went silent: it is asked after the lanes that move
    manifest: Manifest | None = None  # its manifest, once it arrived and fits
    owed: set[int] = field(default_factory=set)  # chunks asked of it, not received
    settled: int = 0  # chunks received from it or given up on: its credit
    received: int = 0


def fetch_state(
    peer: PeerNetwork,
    sources: Sequence[str],
    *,
    timeout: float,
    max_bytes: int,
    chunk_bytes: int = CHUNK_BYTES,
    window: int = WINDOW,
    retry_s: float = RETRY_S,
    patience_s: float = math.inf,
    cancelled: Callable[[], bool] = lambda: False,
    fits: Callable[[Manifest], None] = lambda manifest: None,
    sink: Callable[[Manifest], StateSink] | None = None,
) -> tuple[Snapshot, TransferStats]:
    """The state of ``sources`` (see the module docstring) and how the transfer went. Raises
    StateTransferError naming each source and why it gave nothing usable, also when
    ``cancelled()`` turns true (asked every ``POLL_S``). ``fits`` raises StateTransferError
    for a manifest that does not fit the joiner's model: its source is left out before any
    source's layout is taken as the reference. ``sink`` gives where the chunks of the
    reference's layout go as they come (default: a buffer of the state's size, whose arrays
    the snapshot returned holds; a sink that writes in place leaves the snapshot's empty)."""
    if not sources:
        raise StateTransferError("no source to take the state from")
    if not 1 <= window <= MAX_WINDOW:
        raise ValueError(
            f"window must be in 1..{MAX_WINDOW} chunks (what a source sends ahead), got {window}"
        )
    if not (MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES and chunk_bytes % ALIGN == 0):
        raise ValueError(
            f"chunk_bytes must be a multiple of {ALIGN} in {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}, "
            f"got {chunk_bytes}"
        )
    fetch = _Fetch(peer, sources, max_bytes, chunk_bytes, window, retry_s, patience_s, fits, sink)
    return fetch.run(timeout, cancelled)


class _Fetch:
    def __init__(
        self,
        peer: PeerNetwork,
        sources: Sequence[str],
        max_bytes: int,
        chunk_bytes: int,
        window: int,
        retry_s: float,
        patience_s: float,
        fits: Callable[[Manifest], None],
        sink: Callable[[Manifest], StateSink] | None,
    ) -> None:
        self.peer, self.max_bytes, self.chunk_bytes, self.window = peer, max_bytes, chunk_bytes, window
        self.retry_s, self.patience_s, self.fits, self.sink = retry_s, patience_s, fits, sink
        self.transfer = secrets.randbits(62)
        now = time.monotonic()
        self.lanes = {source: _Lane(source, now, now, now) for source in dict.fromkeys(sources)}
        self.honest = len(self.lanes)  # sources not caught lying: more than half must state counters
        self.assembly: Assembly | None = None
        self.reference: str | None = None  # the source whose manifest the state follows
        self.missing: deque[int] = deque()  # chunks no lane owes
        self.started = now
        self.stats = TransferStats(sources=list(self.lanes))

    def run(self, timeout: float, cancelled: Callable[[], bool]) -> tuple[Snapshot, TransferStats]:
        deadline = self.started + timeout
        while self.assembly is None or not self.assembly.complete or len(self._stated()) < self._quorum:
            now = time.monotonic()
            if cancelled():
                raise self._error("cancelled")
            if now >= deadline:
                raise self._error(f"within {timeout:g} s")
            self._look_after_lanes(now)
            if not self.lanes:
                raise self._error("")
            if len(self.lanes) < self._quorum:
                raise self._error(
                    f"counters stated by {len(self._stated())} of the {self.honest} sources not caught "
                    f"lying, fewer than the {self._quorum} the round is taken from"
                )
            self._ask_for_chunks()
            wake = min([deadline, now + POLL_S, *(lane.manifest_due for lane in self.lanes.values())])
            message = self.peer.recv(max(wake - now, 0.0), JOINER_KINDS)
            if message is not None:
                self._take(message)
        assert self.assembly is not None and self.reference is not None
        try:
            snapshot = self.assembly.snapshot()
        except ValueError as exc:
            raise StateTransferError(f"state from {', '.join(self.stats.chunks)} rejected: {exc}") from None
        stated = self._stated()
        counters = agreed_counters(list(stated.values()))
        for source, theirs in stated.items():
            off = far_from(theirs, counters)
            if off:
                self.stats.outvoted[source] = off
        snapshot = Snapshot(snapshot.tensors, counters)
        self.stats.bytes, self.stats.seconds = self.assembly.manifest.total, time.monotonic() - self.started
        return snapshot, self.stats

    @property
    def _quorum(self) -> int:
        return self.honest // 2 + 1

    def _stated(self) -> dict[str, dict[str, float]]:
        """The counters of each source whose manifest is in."""
        lanes = self.lanes.values()
        return {lane.source: lane.manifest.counters for lane in lanes if lane.manifest is not None}

    def _look_after_lanes(self, now: float) -> None:
        for lane in list(self.lanes.values()):
            waited_on = lane.manifest is None or lane.owed  # (an idle lane owes nothing)
            if waited_on and now - lane.last_message >= self.patience_s:
                self._drop(lane, f"silent for {self.patience_s:g} s", lied=False)
                continue
            if lane.manifest is None and now >= lane.manifest_due:
                ask = StateRequest(self.transfer, manifest=True)
                self.peer.send(lane.source, STATE_REQUEST, 0, meta=ask.encode())
                lane.asks += 1
                lane.manifest_due = now + (REASK_S if lane.asks < QUICK_ASKS else self.retry_s)
            if lane.owed and now - lane.heard >= self.retry_s:
                self.stats.reasked += len(lane.owed)
                lane.stalls += 1
                self._give_back(lane)

    def _ask_for_chunks(self) -> None:
        # until the quorum has stated its counters, a lane takes at most its share of the chunks
        share = None
        if self.assembly is not None and len(self._stated()) < self._quorum:
            share = math.ceil(self.assembly.count / self._quorum)
        for lane in sorted(self.lanes.values(), key=lambda lane: lane.stalls):
            free = self.window - len(lane.owed)
            room = free if share is None else share - lane.received - len(lane.owed)
            if lane.manifest is None or not self.missing or free < max(1, self.window // 4) or room < 1:
                continue  # (asks in batches: a request per few chunks, not per chunk)
            chunks = self._take_missing(min(free, room))
            if not chunks:
                return
            if not lane.owed:
                lane.heard = time.monotonic()  # its stall clock starts now
            lane.owed.update(chunks)
            ask = StateRequest(
                self.transfer, chunk_bytes=self.chunk_bytes, chunks=chunks, settled=lane.settled
            )
            self.peer.send(lane.source, STATE_REQUEST, 0, meta=ask.encode())

    def _take_missing(self, count: int) -> list[int]:
        """Up to ``count`` chunks no lane owes and none delivered (a stalled lane's late ones)."""
        assert self.assembly is not None
        chunks: list[int] = []
        while self.missing and len(chunks) < count:
            index = self.missing.popleft()
            if index not in self.assembly.seen:
                chunks.append(index)
        return chunks

    def _take(self, message: Envelope) -> None:
        lane = self.lanes.get(message.sender)
        if lane is None:
            return
        try:
            payload = (StateManifest if message.kind == STATE_MANIFEST else StateChunk).decode(message.meta)
        except PayloadError as exc:
            self._drop(lane, str(exc))
            return
        if payload.transfer != self.transfer:  # (an answer to an earlier transfer of this node's)
            return
        lane.heard = lane.last_message = time.monotonic()
        try:
            if isinstance(payload, StateManifest):
                self._take_manifest(lane, payload)
            else:
                self._take_chunk(lane, payload.index, message)
        except ValueError as exc:
            self._drop(lane, str(exc))

    def _take_manifest(self, lane: _Lane, payload: StateManifest) -> None:
        manifest = Manifest.parse(payload, self.max_bytes)  # (a source may send it again)
        try:
            self.fits(manifest)
        except StateTransferError as exc:
            raise ValueError(f"its state does not fit this model: {exc}") from None
        if self.assembly is None:
            sink = self.sink(manifest) if self.sink is not None else None
            self.assembly = Assembly(manifest, self.chunk_bytes, sink)
            self.reference = lane.source
            self.missing.extend(range(self.assembly.count))
        elif manifest.entries != self.assembly.manifest.entries:
            raise ValueError(f"its layout differs from {self.reference}'s")
        if lane.manifest is None:
            self.stats.manifest_s[lane.source] = round(time.monotonic() - self.started, 3)
        lane.manifest, lane.manifest_due = lane.manifest or manifest, math.inf

    def _take_chunk(self, lane: _Lane, index: int, message: Envelope) -> None:
        if self.assembly is None:
            raise ValueError(f"chunk {index} before a manifest")
        if self.assembly.add(index, message.tensors):  # (also a late one of a stall, still missing)
            lane.received += 1
            self.stats.chunks[lane.source] = lane.received
        if index in lane.owed:
            lane.owed.discard(index)
            lane.settled += 1

    def _give_back(self, lane: _Lane) -> None:
        """The chunks ``lane`` owes go back to be asked for (they are settled for its credit)."""
        assert self.assembly is not None
        self.missing.extendleft(sorted((i for i in lane.owed if i not in self.assembly.seen), reverse=True))
        lane.settled += len(lane.owed)
        lane.owed.clear()

    def _drop(self, lane: _Lane, why: str, *, lied: bool = True) -> None:
        """Leave ``lane`` out: it ``lied`` (a bad answer), or went silent (it still counts
        among the sources whose majority must state counters: silence may hide honesty)."""
        self.honest -= lied
        if self.assembly is not None:
            self._give_back(lane)
        self.stats.dropped_sources[lane.source] = why
        del self.lanes[lane.source]
        if lane.source == self.reference:  # its counters go with it: another lane's stand
            other = next((other for other in self.lanes.values() if other.manifest is not None), None)
            if other is not None and self.assembly is not None and other.manifest is not None:
                self.reference, self.assembly.manifest = other.source, other.manifest

    def _error(self, why: str) -> StateTransferError:
        got = (
            "nothing"
            if self.assembly is None
            else f"{len(self.assembly.seen)} of {self.assembly.count} chunks"
        )
        reasons = "; ".join(f"{s}: {r}" for s, r in self.stats.dropped_sources.items())
        names = ", ".join(dict.fromkeys([*self.lanes, *self.stats.dropped_sources]))
        error = StateTransferError(
            " ".join(filter(None, [f"state from {names}: {got}", why, reasons and f"({reasons})"]))
        )
        error.dropped = dict(self.stats.dropped_sources)
        return error
