"""Large messages as streams of chunks: the wire form, reassembly and its checks, a transfer
larger than any one socket message, and the receiver's memory during it."""

from __future__ import annotations

import itertools
import time
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import numpy as np
import pytest
from helpers import addresses, peak_memory

from p2p import Transport
from p2p.stream import Assembler
from p2p.wire import MAX_CHUNK_BYTES, Chunk, Limits, Message, WireError, decode, encode_chunks


def stream(tensors: list[np.ndarray], chunk_bytes: int, **fields: Any) -> list[Chunk]:
    messages = encode_chunks(
        kind="params",
        sender="a",
        round=3,
        tensors=tensors,
        seqs=itertools.count(1),
        chunk_bytes=chunk_bytes,
        **fields,
    )
    chunks = [decode(m) for m in messages]
    assert all(isinstance(c, Chunk) for c in chunks)
    return chunks  # type: ignore[return-value]


def assemble(chunks: list[Chunk]) -> Message | None:
    assembler = Assembler()
    results = [assembler.add(c) for c in chunks]
    assert all(r is None for r in results[:-1])
    return results[-1]


def test_chunks_reassemble_several_tensors_across_chunk_boundaries() -> None:
    rng = np.random.default_rng(0)
    tensors = [rng.standard_normal(1001).astype(np.float32), np.arange(7, dtype=np.int8), rng.random((3, 5))]
    chunks = stream(tensors, 1000, meta={"x": 1})
    total = sum(t.nbytes for t in tensors)
    assert [c.index for c in chunks] == list(range(-(-total // 1000)))
    assert all(c.nbytes <= 1000 for c in chunks) and sum(c.nbytes for c in chunks) == total
    message = assemble(chunks)
    assert message is not None and (message.kind, message.round, message.meta) == ("params", 3, {"x": 1})
    for got, sent in zip(message.tensors, tensors, strict=True):
        assert got.dtype == sent.dtype and np.array_equal(got, sent) and not got.flags.writeable


def test_chunk_frames_are_the_tensors_own_memory() -> None:
    vector = np.arange(5000, dtype=np.float32)
    messages = encode_chunks(
        kind="params", sender="a", round=0, tensors=[vector], seqs=itertools.count(), chunk_bytes=4096
    )
    vector[0] = 42.0  # a chunk frame aliases the vector, so the change shows
    assert np.frombuffer(messages[0][1], dtype=np.float32)[0] == 42.0


def test_a_missing_chunk_discards_the_stream_and_a_new_one_replaces_it() -> None:
    vector = np.arange(3000, dtype=np.float32)
    first, second = stream([vector], 4000), stream([vector * 2], 4000)
    assembler = Assembler()
    assert assembler.add(first[0]) is None
    with pytest.raises(WireError) as error:
        assembler.add(first[2])  # chunk 1 was lost
    assert error.value.reason == "chunk_sequence" and assembler.in_progress == 0
    assert assembler.add(first[0]) is None
    for chunk in second[:-1]:  # a new stream replaces the unfinished one
        assert assembler.add(chunk) is None
    message = assembler.add(second[-1])
    assert message is not None and np.array_equal(message.tensors[0], vector * 2)


def test_malformed_chunk_headers_are_refused() -> None:
    vector = np.zeros(100, dtype=np.float32)
    (good,) = encode_chunks(
        kind="params", sender="a", round=0, tensors=[vector], seqs=itertools.count(), chunk_bytes=400
    )
    header = msgpack.unpackb(good[0])
    for place, reason in [
        ([1, 1, 0], "chunk"),
        ([0, 1, 300], "chunk"),
        ([0, 1], "header_schema"),
        ("x", "header_schema"),
    ]:
        bad = [msgpack.packb({**header, "chunk": place}), *good[1:]]
        with pytest.raises(WireError) as error:
            decode(bad)
        assert error.value.reason == reason, place
    with pytest.raises(WireError) as error:
        decode(good, Limits(max_message_bytes=399))  # the whole message's size is checked on every chunk
    assert error.value.reason == "too_large"
    with pytest.raises(ValueError, match="chunk_bytes must be in"):
        encode_chunks(
            kind="p",
            sender="a",
            round=0,
            tensors=[vector],
            seqs=itertools.count(),
            chunk_bytes=MAX_CHUNK_BYTES + 1,
        )


def test_a_delta_larger_than_any_socket_message_arrives_whole_between_small_messages() -> None:
    sender_address, receiver_address = addresses(2)
    big = np.random.default_rng(1).standard_normal(10_000_000).astype(np.float32)  # 40 MB: 5 chunks
    receiver = Transport("b", receiver_address, inbox_kinds={"params", "note"}, limits=Limits(big.nbytes))
    sender = Transport("a", sender_address)
    receiver.start()
    sender.start()
    try:
        deadline = time.monotonic() + 10
        while receiver.recv(0.05) is None and time.monotonic() < deadline:
            sender.send(receiver_address, "note", 0)  # until the connection is up
        sender.send(receiver_address, "params", 1, [big])
        sender.send(receiver_address, "note", 2)
        got = [receiver.recv(10), receiver.recv(10)]
        assert all(m is not None for m in got)
        message = next(m for m in got if m is not None and m.kind == "params")
        assert np.array_equal(message.tensors[0], big)
        assert sender.stats.bytes_sent >= big.nbytes and receiver.stats.rejected == {}
    finally:
        sender.close()
        receiver.close()


def receive_and_measure(address: str, nbytes: int, control: Connection) -> None:
    """Receive one float32 vector of ``nbytes``; report the growth of peak memory (child)."""
    transport = Transport("b", address, inbox_kinds={"params"}, limits=Limits(nbytes))
    transport.start()
    before = peak_memory()
    control.send("ready")
    message = transport.recv(60)
    after = peak_memory()
    control.send((message is not None and float(message.tensors[0][-1]), after - before))
    transport.close()


def test_receiving_a_large_delta_takes_less_than_twice_its_size_in_memory(spawn) -> None:  # type: ignore[no-untyped-def]
    sender_address, receiver_address = addresses(2)
    vector = np.arange(32_000_000, dtype=np.float32)  # 128 MB
    ours, theirs = spawn.Pipe()
    child = spawn.Process(target=receive_and_measure, args=(receiver_address, vector.nbytes, theirs))
    child.start()
    sender = Transport("a", sender_address)
    sender.start()
    try:
        assert ours.poll(60) and ours.recv() == "ready"
        sender.send(receiver_address, "params", 0, [vector])
        assert ours.poll(60)
        last, growth = ours.recv()
        assert last == vector[-1]
        # the assembled delta, plus the chunks ZeroMQ has read ahead while one is copied in
        assert growth < 2 * vector.nbytes, f"peak memory grew {growth / vector.nbytes:.2f}x the delta"
    finally:
        sender.close()
        child.join(10)
