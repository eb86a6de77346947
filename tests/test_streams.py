"""Large messages as streams of chunks: the wire form, reassembly and its checks, a transfer
larger than any one socket message, and the receiver's memory during it."""

from __future__ import annotations

import dataclasses
import itertools
import time
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import numpy as np
import pytest
from helpers import (
    HANG_S,
    addresses,
    connected,
    full_waits,
    peak_memory,
    raw_dealer,
    run_together,
    started_peers,
    started_transport,
    wait_until,
)

from gossip import ADPSGD, CHOCO, Codec, consensus_distance
from gossip.algorithms import adpsgd as adpsgd_module
from gossip.buffers.arrays import own_memory
from gossipmesh.sim.memory import read_only
from p2p import Transport
from p2p.transport.outbound import MAX_STREAMS_PER_PEER
from p2p.transport.reassembly import MAX_STREAMS_PER_SENDER, Assembler
from p2p.wire import (
    CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    Chunk,
    Limits,
    Message,
    WireError,
    decode,
    encode,
    encode_chunks,
)
from topologies import Topology


def stream(tensors: list[np.ndarray], chunk_bytes: int, first_seq: int = 1, **fields: Any) -> list[Chunk]:
    messages = encode_chunks(
        kind="params",
        sender="a",
        round=3,
        tensors=tensors,
        seqs=itertools.count(first_seq),
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


def test_a_reader_may_write_over_a_reassembled_message_and_over_nothing_else() -> None:
    """A large message's reassembly buffer is its own memory (an AD-PSGD passive answers from
    it, CHOCO keeps a full copy in it); a small message's frames are ZeroMQ's and a tensor
    handed over in memory is its sender's: those are never written."""
    tensor = np.arange(3000, dtype=np.float32)
    message = assemble(stream([tensor], 4000))
    assert message is not None
    own = own_memory(message.tensors[0])
    assert own is message.tensors[0] and own.flags.writeable
    small = decode(encode(kind="params", sender="a", round=3, tensors=[tensor[:10]]))
    assert isinstance(small, Message) and own_memory(small.tensors[0]) is None
    assert own_memory(read_only(tensor)) is None and not read_only(tensor).flags.writeable


def test_chunk_frames_are_the_tensors_own_memory() -> None:
    vector = np.arange(5000, dtype=np.float32)
    messages = encode_chunks(
        kind="params", sender="a", round=0, tensors=[vector], seqs=itertools.count(), chunk_bytes=4096
    )
    vector[0] = 42.0  # a chunk frame aliases the vector, so the change shows
    assert np.frombuffer(messages[0][1], dtype=np.float32)[0] == 42.0


def test_chunks_reassemble_in_any_order_and_two_streams_of_one_sender_interleave() -> None:
    """A sender with several connections (``--streams``) spreads each stream's chunks over
    them: they come in any order, and the next stream's before the last of this one."""
    vector = np.arange(3000, dtype=np.float32)
    first, second = stream([vector], 1000), stream([vector * 2], 1000, first_seq=100)
    order = np.random.default_rng(0).permutation(len(first) + len(second))
    assembler = Assembler()
    done = [m for i in order if (m := assembler.add([*first, *second][i])) is not None]
    assert sorted(float(m.tensors[0][1]) for m in done) == [1.0, 2.0]
    assert np.array_equal(done[0].tensors[0], vector * done[0].tensors[0][1])
    assert assembler.in_progress == 0


def _moved(chunk: Chunk, offset: int) -> Chunk:
    return dataclasses.replace(chunk, offset=offset)


def test_chunks_that_do_not_tile_the_payload_are_refused_and_their_stream_dropped() -> None:
    """No byte of a message is ever left unwritten: a chunk twice, or one off its place (an
    overlap that would leave a gap), fails the stream; its late chunks are ignored."""
    vector = np.arange(3000, dtype=np.float32)  # 12,000 bytes: chunks of 4,000
    chunks = stream([vector], 4000)
    for sent in (
        [chunks[0], chunks[0]],
        [chunks[0], _moved(chunks[1], 3996)],
        [_moved(chunks[2], 7996)],  # the last chunk, 4 bytes early: chunks of 3,998 cannot tile 12,000
    ):
        assembler = Assembler()
        for chunk in sent[:-1]:
            assert assembler.add(chunk) is None
        with pytest.raises(WireError) as error:
            assembler.add(sent[-1])
        assert error.value.reason == "chunk_sequence" and assembler.in_progress == 0
        assert assembler.add(chunks[1]) is None and assembler.in_progress == 0  # (late: ignored)


def test_a_senders_oldest_unfinished_streams_are_dropped_beyond_its_cap() -> None:
    vector = np.arange(3000, dtype=np.float32)
    streams = [stream([vector], 4000, first_seq=10 * i) for i in range(MAX_STREAMS_PER_SENDER + 1)]
    assembler = Assembler()
    for chunks in streams:
        assert assembler.add(chunks[0]) is None
    assert assembler.in_progress == MAX_STREAMS_PER_SENDER
    assert all(assembler.add(chunk) is None for chunk in streams[0][1:])  # dropped: ignored
    assert assembler.in_progress == MAX_STREAMS_PER_SENDER
    *_, done = [assembler.add(chunk) for chunk in streams[-1][1:]]
    assert done is not None and np.array_equal(done.tensors[0], vector)


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
    big = np.random.default_rng(1).standard_normal(10_000_000).astype(np.float32)  # 40 MB: 5 chunks
    with connected({}, {"limits": Limits(big.nbytes)}) as (sender, receiver):
        receiver_address = receiver.address
        sender.send(receiver_address, "params", 1, [big])
        sender.send(receiver_address, "note", 2)
        got = [receiver.recv(10), receiver.recv(10)]
        assert all(m is not None for m in got)
        message = next(m for m in got if m is not None and m.kind == "params")
        assert np.array_equal(message.tensors[0], big)
        assert sender.stats.bytes_sent >= big.nbytes and receiver.stats.rejected == {}


def receive_and_measure(address: str, nbytes: int, control: Connection) -> None:
    """Receive one float32 vector of ``nbytes``; report the growth of peak memory (child)."""
    transport = Transport("b", address, inbox_kinds={"params"}, limits=Limits(nbytes))
    transport.start()
    before = peak_memory()
    control.send("ready")
    message = transport.recv(HANG_S)
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
        assert ours.poll(HANG_S) and ours.recv() == "ready"
        sender.send(receiver_address, "params", 0, [vector])
        assert ours.poll(HANG_S)
        last, growth = ours.recv()
        assert last == vector[-1]
        # the assembled delta, plus the chunks ZeroMQ has read ahead while one is copied in
        assert growth < 2 * vector.nbytes, f"peak memory grew {growth / vector.nbytes:.2f}x the delta"
    finally:
        sender.close()
        child.join(10)


def test_streams_spread_over_several_connections_arrive_whole_and_in_turn() -> None:
    """``streams=4``: each large message's chunks go over 4 connections to the peer, in turn;
    the receiver takes them in any order, keeps each connection's seqs apart (none looks
    replayed) and yields every message whole."""
    vectors = [
        np.random.default_rng(i).standard_normal(300_000).astype(np.float32)
        for i in range(MAX_STREAMS_PER_PEER)
    ]
    small = {"chunk_bytes": 1 << 16}
    with connected({**small, "streams": 4}, {**small, "limits": Limits(vectors[0].nbytes)}) as (
        sender,
        receiver,
    ):
        receiver_address = receiver.address
        sender.send(receiver_address, "params", 99, [vectors[0]])  # (the 4 stream connections come
        first = receiver.recv(10, {"params"})  # up: meanwhile their chunks wait, as on any new one)
        assert first is not None and np.array_equal(first.tensors[0], vectors[0])
        for round, vector in enumerate(vectors):  # 19 chunks each, 5 or 4 a connection
            sender.send(receiver_address, "params", round, [vector])
            sender.send(receiver_address, "note", round)
        got = [receiver.recv(10, {"params"}) for _ in vectors]
        assert [m.round for m in got if m is not None] == list(range(len(vectors)))
        for message, vector in zip(got, vectors, strict=True):
            assert message is not None and np.array_equal(message.tensors[0], vector)
        assert len(sender.connections) == 5 and receiver.stats.rejected == {}
        assert sender.stats.messages_sent >= 2 * len(vectors)


def test_choco_adds_updates_spread_over_several_connections_to_its_sum() -> None:
    """``streams=2`` between three real nodes: each CHOCO update (int8, two chunks) goes over
    two connections, so its pieces may come in either order; every node adds every update to
    its sum (no piece refused, no restart) and the three reach one model."""
    size = CHUNK_BYTES + CHUNK_BYTES // 2
    vectors = [np.random.default_rng(i).standard_normal(size).astype(np.float32) for i in range(3)]
    with started_peers([f"n{i}" for i in range(3)], streams=2) as peers, full_waits():
        nodes = [
            CHOCO(
                peer,
                vector,
                topology=Topology.parse("complete"),
                codec=Codec.parse("int8"),
                stragglers="wait",
                round_timeout=30,  # (an update of 6 MB: a refused piece costs a round this)
            )
            for peer, vector in zip(peers, vectors, strict=True)
        ]
        run_together((lambda n=n: [n.after_step() for _ in range(20)]) for n in nodes)
    assert [(n.sum_restarts, dict(n.rejected)) for n in nodes] == [(0, {})] * 3
    assert consensus_distance(vectors) < 1e-4


def test_adpsgd_exchanges_a_streamed_model_by_turns_over_real_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four real nodes on a ring, each model 1.5 chunks (streamed), every model asking for a
    turn: the passives answer each request by turn, from its reassembly buffer; the mean is
    kept and the models meet."""
    monkeypatch.setattr(adpsgd_module, "ASK_ABOVE_BYTES", CHUNK_BYTES)
    size = (CHUNK_BYTES + CHUNK_BYTES // 2) // 4
    vectors = [np.random.default_rng(i).standard_normal(size).astype(np.float32) for i in range(4)]
    target = np.mean(np.array(vectors, dtype=np.float64), axis=0)
    spread = consensus_distance(vectors)
    with started_peers([f"n{i}" for i in range(4)]) as peers, full_waits():
        ring = Topology.parse("ring")
        nodes = [ADPSGD(peer, vector, topology=ring) for peer, vector in zip(peers, vectors, strict=True)]
        assert all(node._asks_first for node in nodes)
        done = wait_until(lambda: min(n.exchanges for n in nodes) >= 6)
        for node in nodes:
            node.close()
    assert done, [n.exchanges for n in nodes]
    assert [dict(n.rejected) for n in nodes] == [{}] * 4
    assert sum(n.dropped["pair_without_turn"] for n in nodes) == 0
    np.testing.assert_allclose(np.mean(np.array(vectors, dtype=np.float64), axis=0), target, atol=1e-5)
    assert consensus_distance(vectors) < 0.5 * spread


def test_each_connection_lane_keeps_its_own_sequence_and_a_lane_out_of_range_is_refused() -> None:
    """A sender's lanes (``NODE/TOKEN/LANE`` routing ids) each take increasing seqs, apart from
    the others'; a replay within a lane is refused, and so is a lane beyond 0..16."""
    with started_transport("rx", inbox_kinds={"note"}) as receiver:
        # the replay goes on the same connection: a second connection of the same routing id
        # would take the id over at the ROUTER (ROUTER_HANDOVER) while the first one's close is
        # not yet seen there (a busy machine), and what the first still carried could be lost
        cases = [(b"x/t0", (5,)), (b"x/t1/3", (5, 5)), (b"x/t2/17", (6,)), (b"x/t3/ab", (7,))]
        sent = 0
        for routing_id, seqs in cases:
            with raw_dealer(routing_id, receiver.address) as dealer:
                time.sleep(0.05)  # (the raw socket has no handshake wait)
                for seq in seqs:
                    dealer.send_multipart(encode(kind="note", sender="x", round=0, session=1, seq=seq))
                    sent += 1
                    assert wait_until(lambda n=sent: _taken(receiver) >= n)
        assert receiver.stats.messages_received == 2
        assert receiver.stats.rejected == {"replayed": 1, "bad_lane": 2}


def _taken(transport: Transport) -> int:
    """Messages a transport received or rejected."""
    return transport.stats.messages_received + transport.stats.messages_rejected


def test_a_stream_begun_whole_is_finished_whole_when_its_reader_asks_for_pieces_midway() -> None:
    """A node's algorithm asks for its kind piece by piece once it starts; a neighbour's stream
    whose first chunks came before is assembled to the end, not lost half copied."""
    vector = np.arange(3000, dtype=np.float32)
    chunks = stream([vector], 4000)
    assembler = Assembler()
    assert assembler.add(chunks[0]) is None
    results = [assembler.piece(chunk) for chunk in chunks[1:]]
    assert all(r is None for r in results[:-1])
    whole = results[-1]
    assert whole is not None and whole.piece is None and np.array_equal(whole.tensors[0], vector)
    later = stream([vector], 4000, first_seq=100)  # the next stream comes piece by piece
    assert all(p is not None and p.piece is not None for p in map(assembler.piece, later))
