"""Credit for streams: a receiver holds at most a window of a stream its reader has not taken,
the rest waits in the sender's memory; whole messages do not wait behind such a stream; a
stream that gets no credit is dropped in the end; a malformed credit is refused."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from helpers import HANG_S, connected, raw_dealer, started_transport, wait_until

import p2p.transport.outbound as outbound
from p2p import Transport
from p2p.transport.credits import CREDIT
from p2p.wire import Limits, encode

CHUNK = 1 << 20
WINDOW = outbound.WINDOW_BYTES // CHUNK  # chunks a stream runs ahead of its receiver's credit


@contextmanager
def piece_taker(vector_bytes: int) -> Iterator[tuple[Transport, Transport]]:
    """A sender "a" and a receiver "b" that takes ``params`` piece by piece, connected."""
    options = {"chunk_bytes": CHUNK}
    with connected(options, {**options, "limits": Limits(vector_bytes)}) as (sender, receiver):
        receiver.take_pieces({"params"})
        yield sender, receiver


def _stalled(sender: Transport) -> bool:
    """Whether the sender's stream waits for credit (having sent its window)."""
    result: list[bool] = []
    sender.call(lambda: result.append(any(q[0].waiting_since for q in sender._outbound._streams.values())))
    return bool(result and result[0])


def _pieces(receiver: Transport, count: int) -> list[tuple[int, int, np.ndarray]]:
    """(round, offset, a copy of the bytes) of the next ``count`` pieces, each let go of as a
    reader does once it has mixed a piece in."""
    pieces = []
    for _ in range(count):
        piece = receiver.recv(HANG_S, {"params"})
        assert piece is not None and piece.piece is not None
        pieces.append((piece.round, piece.piece.offset, np.concatenate(piece.tensors)))
    return pieces


def test_a_stream_its_reader_has_not_taken_waits_at_the_sender_past_a_window_and_notes_pass_it() -> None:
    vector = np.random.default_rng(0).standard_normal(10 * WINDOW * CHUNK // 4).astype(np.float32)
    chunks = vector.nbytes // CHUNK
    with piece_taker(vector.nbytes) as (sender, receiver):
        sender.send(receiver.address, "params", 1, [vector])
        sender.send(receiver.address, "note", 2)
        note = receiver.recv(HANG_S, {"note"})  # (not behind the stream, which waits for credit)
        assert note is not None and note.round == 2
        assert wait_until(lambda: _stalled(sender))
        # the receiver holds the window, not the stream, and the rest has not left the sender
        assert wait_until(lambda: receiver._inbox.nbytes >= WINDOW * CHUNK)
        held = receiver._inbox.nbytes
        assert held == WINDOW * CHUNK, f"{held / CHUNK} chunks held"
        assert sender.backlog(receiver.address) == 1
        pieces = sorted(_pieces(receiver, chunks), key=lambda p: p[1])  # credit as each is let go of
        got = np.concatenate([data for _, _, data in pieces])
        assert np.array_equal(got.view(np.float32), vector)
        assert wait_until(lambda: sender.backlog(receiver.address) == 0)
        assert receiver.stats.rejected == {}
        assert not [reason for reason in sender.stats.dropped if reason.startswith("stream")]


def test_chunks_a_reader_holds_count_against_the_window_until_it_lets_go_of_them() -> None:
    vector = np.ones(3 * WINDOW * CHUNK // 4, dtype=np.float32)
    with piece_taker(vector.nbytes) as (sender, receiver):
        sender.send(receiver.address, "params", 1, [vector])
        kept = [receiver.recv(HANG_S, {"params"}) for _ in range(WINDOW)]  # taken, and still held
        assert wait_until(lambda: _stalled(sender))
        assert receiver._inbox.nbytes == 0
        assert receiver.stats.bytes_received < (WINDOW + 1) * CHUNK + (64 << 10)
        del kept  # released: the next window comes
        more = _pieces(receiver, WINDOW)
        assert {offset // CHUNK for _, offset, _ in more} == set(range(WINDOW, 2 * WINDOW))


def test_a_stream_that_gets_no_credit_is_dropped_and_the_next_one_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(outbound, "CREDIT_WAIT_S", 0.2)
    first = np.ones(2 * WINDOW * CHUNK // 4, dtype=np.float32)
    second = np.full(2 * CHUNK // 4, 2.0, dtype=np.float32)  # a stream of 2 chunks, behind the first
    with piece_taker(first.nbytes) as (sender, receiver):
        sender.send(receiver.address, "params", 1, [first])
        assert wait_until(lambda: _stalled(sender))
        sender.send(receiver.address, "params", 2, [second])
        assert wait_until(lambda: sender.stats.dropped.get("stream_credit_timeout") == 1)
        taken = sorted(_pieces(receiver, WINDOW + 2), key=lambda p: p[:2])
        assert [r for r, _, _ in taken] == [1] * WINDOW + [2, 2]
        assert np.array_equal(np.concatenate([data for _, _, data in taken[-2:]]).view(np.float32), second)
        assert wait_until(lambda: sender.backlog(receiver.address) == 0)


@pytest.mark.parametrize(
    "meta",
    [{}, {"session": 1, "stream": -1, "released": 0}, {"session": 1, "stream": 2, "released": "x"}],
)
def test_a_malformed_credit_is_refused(meta: dict[str, object]) -> None:
    with started_transport("rx", inbox_kinds={"note"}) as receiver:
        with raw_dealer(b"x/t0", receiver.address) as dealer:
            time.sleep(0.05)  # (the raw socket has no handshake wait)
            dealer.send_multipart(encode(kind=CREDIT, sender="x", round=0, meta=meta, session=1, seq=1))
            assert wait_until(lambda: receiver.stats.messages_rejected >= 1)
        assert receiver.stats.rejected == {"bad_credit": 1}
