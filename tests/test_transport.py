"""The transport between real processes, and what a dead or hostile peer can and cannot do."""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from helpers import (
    HANG_S,
    addresses,
    average_in_threads,
    echo_peer,
    idle_peer,
    raw_dealer,
    started_peers,
    started_transport,
    wait_until,
)
from zmq.utils.monitor import recv_monitor_message

from gossip import DPSGD
from gossip.algorithms.averager import RoundStats
from p2p import Peer, Transport, TransportError
from p2p.address import AddressError, free_ports, parse_endpoint
from p2p.transport.send_cap import SendPacer
from p2p.wire import MAX_CHUNK_BYTES, encode
from topologies import Topology


def test_two_processes_exchange_a_tensor(spawn) -> None:  # type: ignore[no-untyped-def]
    mine, theirs = addresses(2)
    child = spawn.Process(target=echo_peer, args=("echo", theirs), daemon=True)
    child.start()
    transport = Transport("asker", mine, inbox_kinds={"params"})
    transport.start()
    try:
        vector = np.random.default_rng(1).standard_normal(250_000).astype(np.float32)
        reply = None
        deadline = time.monotonic() + HANG_S
        while reply is None and child.is_alive():  # the child needs a moment to import and bind
            assert time.monotonic() < deadline, "no reply from the echo process"
            transport.send(theirs, "params", 5, [vector], meta={"reply_to": mine})
            reply = transport.recv(0.5)
        assert reply is not None, "no reply from the echo process"
        assert (reply.sender, reply.round) == ("echo", 5)
        np.testing.assert_array_equal(reply.tensors[0], vector * 2)
        assert isinstance(_memory_owner(reply.tensors[0]), zmq.Frame)  # no copy out of ZeroMQ
        assert transport.stats.bytes_received >= vector.nbytes
        assert transport.stats.bytes_sent >= vector.nbytes
    finally:
        transport.close()


def _memory_owner(array: np.ndarray) -> object:
    base: object = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def test_a_killed_neighbour_costs_one_wait_then_none(spawn) -> None:  # type: ignore[no-untyped-def]
    with started_peers(["a", "b"]) as peers:
        child = spawn.Process(target=idle_peer, args=("c", addresses(1)[0], [peers[0].address]))
        child.start()
        assert wait_until(lambda: all(p.members() == {"a", "b", "c"} for p in peers))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        vectors = [np.full(4, 1.0), np.full(4, 3.0)]
        durations = average_in_threads(peers, vectors, topology="complete", rounds=5, timeout=2.0)
    for per_node in durations:  # a round that waits for c lasts the timeout; one that does not, ms
        assert per_node[0] >= 2.0, per_node  # waited for c once...
        assert max(per_node[1:]) < 2.0, per_node  # ...and never again
    # a and b still averaged with each other every round: both hold the mean of their values
    np.testing.assert_allclose(vectors[0], vectors[1])


def test_a_leaving_neighbour_is_not_waited_for() -> None:
    with started_peers(["a", "b", "c"]) as peers:
        peers[2].close()
        # both must know: one still counting c in its ring waits its round out for c
        assert wait_until(lambda: all(p.members() == {"a", "b"} for p in peers[:2]))
        vectors = [np.full(3, 1.0), np.full(3, 5.0)]
        stats: list[list[RoundStats]] = [[], []]
        durations = average_in_threads(
            peers[:2], vectors, topology="ring", rounds=3, timeout=2.0, stats=stats
        )
    rounds = [(s.expected, s.arrived) for per_node in stats for s in per_node]
    assert rounds == [(1, 1)] * 6, rounds  # c is no neighbour in any round
    assert max(max(d) for d in durations) < 2.0  # no round waited its timeout out
    np.testing.assert_allclose(vectors[0], [3.0] * 3)


def test_sends_to_an_unreachable_address_return_at_once_and_are_counted() -> None:
    transport = Transport("lonely", "tcp://127.0.0.1:0", inbox_kinds={"params"})
    transport.start()
    try:
        nowhere = addresses(1)[0]
        started = time.monotonic()
        for r in range(100):
            transport.send(nowhere, "params", r, [np.zeros(1000, np.float32)])
        assert time.monotonic() - started < 1.0
        assert wait_until(lambda: transport.stats.dropped["peer_unreachable_or_full"] == 100)
        assert transport.stats.bytes_sent == 0
        assert wait_until(lambda: transport.backlog(nowhere) == 0)  # dropped: nothing leaves
    finally:
        transport.close()


def test_the_backlog_is_what_a_peer_that_does_not_read_has_not_taken() -> None:
    """A peer that reads nothing takes what its buffers hold (a few hundred kB here); the rest
    of eight 4 MB values stays on its way out until it reads."""
    context = zmq.Context()
    peer = context.socket(zmq.ROUTER)
    peer.setsockopt(zmq.RCVHWM, 1)
    peer.setsockopt(zmq.RCVBUF, 1 << 16)
    address = f"tcp://127.0.0.1:{peer.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        with started_transport("tx") as sender:
            value = np.zeros(1 << 20, np.float32)
            for r in range(8):
                sender.send(address, "params", r, [value], member=True)
            assert wait_until(lambda: sender.stats.messages_sent == 8)
            assert sender.backlog(address) >= 6
            for _ in range(8):
                assert peer.poll(HANG_S * 1000) and peer.recv_multipart()
            assert wait_until(lambda: sender.backlog(address) == 0)
    finally:
        peer.close(0)
        context.term()


def test_under_a_send_cap_what_waits_is_backlog_and_what_its_queue_drops_is_not() -> None:
    """70 values at 100 bytes/s: the first goes to ZeroMQ (the cap goes into debt), 64 wait their
    turn, the oldest 5 beyond them are dropped and no longer count."""
    with (
        started_transport("capped", max_send_bytes_per_s=100.0) as sender,
        started_transport("rx") as receiver,
    ):
        for r in range(70):
            sender.send(receiver.address, "params", r, [np.zeros(1000, np.float32)], member=True)
        assert wait_until(lambda: sender.stats.dropped["send_cap_backlog"] == 5)
        assert sender.backlog(receiver.address) in (64, 65)  # (65: the first not sent on yet)


def test_bad_messages_are_counted_per_reason_and_never_delivered() -> None:
    with (
        started_transport("rx", inbox_kinds={"params"}) as receiver,
        raw_dealer(b"intruder", receiver.address) as raw,
    ):
        raw.send_multipart([b"\xc1garbage"])
        raw.send_multipart(encode(kind="params", sender="someone-else", round=0))
        raw.send_multipart(encode(kind="nonsense", sender="intruder", round=0, seq=5))
        raw.send_multipart(encode(kind="params", sender="intruder", round=0, seq=7))
        raw.send_multipart(encode(kind="params", sender="intruder", round=1, seq=7))  # replayed seq
        header = msgpack.packb({"v": 1})
        raw.send_multipart([header])
        assert wait_until(lambda: receiver.stats.messages_rejected == 5), receiver.stats
        assert receiver.stats.rejected == {
            "header_not_msgpack": 1,
            "sender_mismatch": 1,
            "unknown_kind": 1,
            "replayed": 1,
            "header_schema": 1,
        }
        assert set(receiver.stats.rejected_by_peer) == {"intruder"}
        delivered = receiver.recv(1.0)
        assert delivered is not None and delivered.seq == 7 and delivered.round == 0
        assert receiver.recv(0.2) is None


def test_a_sender_is_heard_again_over_the_connection_it_reopened_while_the_receiver_was_busy() -> None:
    """A DEALER whose connection drops (here: a frame over the receiver's size limit) reconnects
    under the same routing id. The new connection comes while the receiving thread is held, so
    libzmq still holds the old one under that id: without ROUTER_HANDOVER it filed the new one
    where nothing is read, and every message after the drop was lost."""
    held, release = threading.Event(), threading.Event()
    with (
        started_transport("rx", inbox_kinds={"params"}) as receiver,
        raw_dealer(b"x/t0", receiver.address) as raw,
    ):
        connects = raw.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        assert connects.poll(HANG_S * 1000) and recv_monitor_message(connects)
        sent = time.monotonic()
        raw.send_multipart(encode(kind="params", sender="x", round=0, seq=1))
        first = receiver.recv(HANG_S)
        # measured: the message after the reconnection takes what this one took, not 10 s more
        patience = max(10.0, 20 * (time.monotonic() - sent))
        assert first is not None and first.round == 0

        def hold() -> None:  # (on the receiver's network thread)
            held.set()
            release.wait(HANG_S)

        receiver.call_soon(hold)
        assert held.wait(HANG_S)
        raw.send(bytes(2 * MAX_CHUNK_BYTES))  # over the ROUTER's MAXMSGSIZE: it drops the connection
        assert connects.poll(HANG_S * 1000) and recv_monitor_message(connects)  # reconnected
        raw.send_multipart(encode(kind="params", sender="x", round=1, seq=2))
        release.set()
        again = receiver.recv(patience)
        raw.disable_monitor()
        connects.close(0)
    assert again is not None and again.round == 1


def test_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        transport = Transport("x", f"tcp://127.0.0.1:{port}", inbox_kinds=())
        with pytest.raises(TransportError, match=rf"tcp://127.0.0.1:{port} is in use; .* port 0"):
            transport.start()


def test_a_port_picked_is_not_picked_again_before_it_is_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine's ranks' ports, then its collective's: the second pick drew the first's port,
    still free since no rank had bound it yet, and a rank then found it in use."""
    first = free_ports(1)[0]
    draws = itertools.chain([first, first], range(first + 1, first + 100))  # (one may be in use)
    monkeypatch.setattr("p2p.address.random.choice", lambda _: next(draws))
    assert free_ports(1) != [first]


def test_unusable_listen_address_is_a_clear_error() -> None:
    transport = Transport("x", "tcp://192.0.2.1:7000", inbox_kinds=())
    with pytest.raises(TransportError, match=re.escape("cannot listen on tcp://192.0.2.1:7000")):
        transport.start()


@pytest.mark.parametrize("text", ["localhost", "tcp://h:99999", "udp://h:1", "h:port", ""])
def test_bad_addresses_are_refused(text: str) -> None:
    with pytest.raises(AddressError, match="expected tcp://HOST:PORT"):
        parse_endpoint(text)


def test_no_answer_from_bootstrap_is_a_clear_error() -> None:
    silent = addresses(1)[0]
    peer = Peer("alone", "tcp://127.0.0.1:0", [silent])
    peer.start()
    try:
        with pytest.raises(TransportError, match=re.escape(f"could not join through {silent} within 0.5 s")):
            peer.wait_ready(0.5)
    finally:
        peer.close()


def test_too_few_members_is_a_clear_error() -> None:
    expected = re.escape("only 2 of the 3 expected members joined within 0.3 s")
    with started_peers(["a", "b"]) as (a, _), pytest.raises(TransportError, match=expected):
        a.wait_ready(0.3, expect=3)


def test_mismatched_tensors_are_rejected_by_the_algorithm() -> None:
    with started_peers(["a", "b"]) as (a, b):
        a.send("b", "params", 0, [np.zeros(3, np.float32)])  # wrong dtype for b's float64 model
        a.send("b", "params", 0, [np.full(4, np.nan)])  # non-finite
        a.send("b", "params", 0, [np.zeros(5)])  # wrong shape
        averager = DPSGD(b, np.ones(4), topology=Topology.parse("ring"), round_timeout=0.5)
        stats = averager.average()
    assert stats.arrived == 0
    assert averager.rejected == {"tensor_mismatch": 2, "non_finite": 1}
    np.testing.assert_array_equal(averager.params, np.ones(4))


def test_a_leave_names_the_last_round_its_sender_took_part_in() -> None:
    with started_peers(["a", "b", "c"]) as (a, _, c):
        c.leave(after_round=5)
        assert wait_until(lambda: "c" not in a.members())
        assert a.members(5) == {"a", "b", "c"}  # c sent its messages for rounds up to 5
        assert a.members(6) == {"a", "b"}
        c.close()  # a second leave is not sent: the first one stands
        time.sleep(0.2)
        assert a.members(5) == {"a", "b", "c"}


def test_the_send_pacer_goes_into_debt_for_a_send_and_refills_at_its_rate() -> None:
    now = [0.0]
    pacer = SendPacer(1000.0, clock=lambda: now[0])  # 1,000 bytes a second, 50 in the bucket
    assert pacer.wait_s() == 0
    pacer.spend(1050)  # a message leaves whole: the bucket owes 1,000 bytes
    assert pacer.wait_s() == pytest.approx(1.0)
    now[0] = 0.6
    assert pacer.wait_s() == pytest.approx(0.4)
    now[0] = 10.0  # idle: the bucket holds at most 50 ms of the rate, not 10 s
    pacer.spend(100)
    assert pacer.wait_s() == pytest.approx(0.05)
    with pytest.raises(ValueError, match="a send cap must be > 0 bytes/s"):
        SendPacer(0)
