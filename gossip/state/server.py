"""A member's side of state transfer: answering newcomers' manifest and chunk requests.

A transfer goes at the link's pace, not the training loop's: from the first training step on
(:meth:`StateServer.start`), requests are answered as they come by a thread of its own
(``PeerNetwork.start_background``), so a newcomer never waits for a member's step to end (a
step of a large model takes seconds, which a whole transfer may not). Each chunk is read from
the live state when it is asked for (``gossip.state.live``), so serving costs no copy of the
state, only the chunks in flight.

What a requester can make a source do is bounded: it answers members only, at most
``MAX_TRANSFERS`` requesters at once (a slot is taken over from a requester silent for
``RETRY_S``), at most ``MAX_WINDOW`` chunks a request and beyond what the requester says it
settled, chunks of ``MIN_CHUNK_BYTES`` to ``MAX_CHUNK_BYTES``, only after a manifest (a chunk
request without one is answered with the manifest); ``refused`` counts what it let go. A
requester that claims more settled than it received makes its source read sooner, not hold
more: what the source sends waits in the transport's bounded queues (``p2p.transport.outbound``).
Whatever it claims, a member gets at most ``STATE_COPIES`` times the state's bytes (or of a
window of chunks, if larger) from this source while it stays a member, over all its transfers:
enough for a joiner that tries again,
never the endless stream a requester claiming "all settled" would get otherwise.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import Counter
from dataclasses import dataclass

from gossip.messages import (
    STATE_CHUNK,
    STATE_MANIFEST,
    STATE_REQUEST,
    PayloadError,
    StateChunk,
    StateRequest,
)
from gossip.network import Background, Envelope, PeerNetwork
from gossip.state.manifest import (
    ALIGN,
    MAX_CHUNK_BYTES,
    MAX_WINDOW,
    MIN_CHUNK_BYTES,
    Manifest,
    StateView,
)

MAX_TRANSFERS = 4  # requesters served at once
RETRY_S = 3.0  # a requester silent this long no longer counts as being served
POLL_S = 0.25  # how often the serving thread looks whether it was closed
STATE_COPIES = 4  # a member's share of this source's reads: this many times the state


@dataclass
class _Transfer:
    id: int
    heard: float  # when its last request came
    sent: int = 0  # chunks sent
    total: int | None = None  # the state's bytes, as its manifest said (None: none sent yet)


class StateServer:
    """Answers newcomers' state requests from ``view`` (see the module docstring)."""

    def __init__(self, peer: PeerNetwork, view: StateView) -> None:
        self._peer = peer
        self._view = view
        self._transfers: dict[str, _Transfer] = {}  # requester -> its transfer
        self._bytes_sent: Counter[str] = Counter()  # member -> bytes sent it, all its transfers
        self._lock = threading.Lock()  # the training loop and the serving thread
        self._thread: Background | None = None
        self._stop = threading.Event()
        self.refused: Counter[str] = Counter()
        self.chunks_sent = 0

    def start(self) -> None:
        """Answer requests as they come, on a thread of its own, until :meth:`close` (once;
        later calls do nothing)."""
        if self._thread is None and not self._stop.is_set():
            serving = functools.partial(_serve, weakref.ref(self), self._peer, self._stop)
            self._thread = self._peer.start_background(f"state-{self._peer.node_id}", serving)

    def serve(self, wait: float = 0.0) -> int:
        """Answer the requests waiting (the first for up to ``wait`` s); how many were taken."""
        answered = 0
        while not self._stop.is_set():
            request = self._peer.recv(wait if not answered else 0, (STATE_REQUEST,))
            if request is None:
                break
            self._answer(request)
            answered += 1
        return answered

    def close(self) -> None:
        """Stop answering (the thread ends within ``POLL_S``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _answer(self, request: Envelope) -> None:
        with self._lock:
            try:
                ask = StateRequest.decode(request.meta)
            except PayloadError:
                ask = None
            reason = self._refusal(request.sender, ask)
            if reason is not None:
                self.refused[reason] += 1
                return
            assert ask is not None
            requester = request.sender
            transfer = self._transfers[requester]
            if ask.manifest or transfer.total is None:  # (chunks follow a manifest)
                entries, counters = self._view.manifest()
                transfer.total = sum(entry.span for entry in entries)
                manifest = Manifest.message(entries, counters, transfer.id)
                self._peer.send(requester, STATE_MANIFEST, 0, meta=manifest.encode())
                return
            total = transfer.total
            assert ask.chunk_bytes is not None and ask.chunks is not None and ask.settled is not None
            chunk_bytes, chunks = ask.chunk_bytes, ask.chunks
            credit = MAX_WINDOW - (transfer.sent - min(ask.settled, transfer.sent))
            allowance = STATE_COPIES * max(total, MAX_WINDOW * chunk_bytes)
            if len(chunks) > credit:
                self.refused["beyond_window"] += 1
                chunks = chunks[: max(credit, 0)]
            for index in chunks:
                start = index * chunk_bytes
                if not 0 <= start < max(total, 1):
                    self.refused["bad_chunk"] += 1
                    continue
                stop = min(start + chunk_bytes, total)
                if self._bytes_sent[requester] + stop - start > allowance:
                    self.refused["beyond_state_copies"] += 1
                    break
                self._bytes_sent[requester] += stop - start
                piece = self._view.read(start, stop)
                self._peer.send(requester, STATE_CHUNK, 0, [piece], StateChunk(transfer.id, index).encode())
                transfer.sent += 1
                self.chunks_sent += 1

    def _refusal(self, requester: str, ask: StateRequest | None) -> str | None:
        """Why ``requester``'s request (None: one that did not decode) is not answered, or None
        (then its transfer is known)."""
        now = self._peer.now()
        members = self._peer.members()
        for gone in [r for r in self._transfers if r not in members]:
            del self._transfers[gone]
        for gone in [r for r in self._bytes_sent if r not in members]:
            del self._bytes_sent[gone]
        if ask is None or not _well_formed(ask):
            return "malformed"
        if requester not in members:
            return "not_a_member"
        transfer = self._transfers.get(requester)
        if transfer is None or transfer.id != ask.transfer:
            if transfer is None and len(self._transfers) >= MAX_TRANSFERS:
                idlest = min(self._transfers, key=lambda r: self._transfers[r].heard)
                if now - self._transfers[idlest].heard < RETRY_S:
                    return "busy"
                del self._transfers[idlest]  # (one silent this long gave up, or asks again anew)
            transfer = self._transfers[requester] = _Transfer(ask.transfer, now)
        transfer.heard = now
        return None


def _serve(server: weakref.ref[StateServer], peer: PeerNetwork, stop: threading.Event) -> None:
    """The serving thread: it holds its server only while it answers a request, so a server
    nobody else holds (an optimizer dropped without ``close``) is collected and its thread ends."""
    while not stop.is_set():
        request = peer.recv(POLL_S, (STATE_REQUEST,))
        alive = server()
        if alive is None:
            return
        if request is not None:
            alive._answer(request)
        del alive


def _well_formed(ask: StateRequest) -> bool:
    if ask.manifest:
        return True
    chunk_bytes, chunks, settled = ask.chunk_bytes, ask.chunks, ask.settled
    return (
        chunk_bytes is not None
        and MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES
        and chunk_bytes % ALIGN == 0
        and settled is not None
        and settled >= 0
        and chunks is not None
        and len(chunks) <= MAX_WINDOW
    )
