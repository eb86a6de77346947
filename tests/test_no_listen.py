"""Members that accept no connection (``--no-listen``): reached over the connections they open."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from helpers import HANG_S, addresses, wait_until
from test_security import curve_for, make_keys

from gossipmesh.config import ConfigError, MeshConfig, NodeConfig, load
from p2p import Peer, Transport, TransportError
from p2p.membership.table import Member, Status
from p2p.wire import CHUNK_BYTES
from topologies import Topology
from topologies.members import mixing_row


@contextmanager
def listeners_and_one_behind_nat(folder: Path) -> Iterator[tuple[Peer, Peer, Peer]]:
    """Members a and b, which listen, and c, which does not (CURVE on), all three joined."""
    trusted = make_keys(folder, "a", "b", "c")
    listen = addresses(2)
    a = Peer("a", listen[0], curve=curve_for(folder, "a", trusted))
    b = Peer("b", listen[1], listen[:1], curve=curve_for(folder, "b", trusted))
    c = Peer("c", None, listen[:1], curve=curve_for(folder, "c", trusted))
    try:
        for peer in (a, b, c):
            peer.start()
        for peer in (a, b, c):
            peer.wait_ready(HANG_S, expect=3)
        yield a, b, c
    finally:
        for peer in (a, b, c):
            peer.close()


def _record(peer: Peer, node_id: str) -> Member | None:
    return next((m for m in peer.membership.view if m.id == node_id), None)


def test_a_member_that_does_not_listen_joins_is_reached_and_is_detected_dead(tmp_path: Path) -> None:
    """Two listening members and one that does not (CURVE on): all three see one another, both
    listeners reach it (a message, and a stream of chunks larger than any single message)
    along the routes its connections opened, it reaches both; killed, it is detected dead."""
    with listeners_and_one_behind_nat(tmp_path) as (a, b, c):
        assert c.transport.address == "inbound://c"
        assert wait_until(lambda: all(_record(p, "c") is not None for p in (a, b)))
        assert [_record(p, "c").reachable for p in (a, b)] == [False, False]  # type: ignore[union-attr]
        big = np.arange(CHUNK_BYTES // 4 * 2 + 100, dtype=np.float32)  # three chunks
        a.send("c", "params", 1, [np.ones(10, np.float32)])
        b.send("c", "params", 2, [big])
        got = {m.sender: m for m in (c.recv(20, {"params"}), c.recv(20, {"params"})) if m is not None}
        assert sorted(got) == ["a", "b"]
        np.testing.assert_array_equal(got["b"].tensors[0], big)
        for peer in (a, b):
            c.send(peer.node_id, "params", 3, [np.full(4, 7, np.float32)])
            reply = peer.recv(20, {"params"})
            assert reply is not None and reply.sender == "c"
        assert c.stats.dropped["peer_unreachable_or_full"] == 0
        c.transport.close()  # a crash: no leave
        assert wait_until(lambda: _record(a, "c").status == Status.DEAD)  # type: ignore[union-attr]
        assert wait_until(lambda: _record(b, "c").status == Status.DEAD)  # type: ignore[union-attr]
        assert {m.id: m.status for m in a.membership.view} == {
            "a": Status.ALIVE,
            "b": Status.ALIVE,
            "c": Status.DEAD,
        }


def test_a_listener_with_a_route_back_reads_what_its_router_holds_as_the_routers(tmp_path: Path) -> None:
    """A route back to a member that does not listen goes over the listener's ROUTER; what the
    ROUTER holds is read as the ROUTER's input, never as that route's (read so, other members'
    messages lose their routing frame and are rejected in the routed member's name)."""
    with listeners_and_one_behind_nat(tmp_path) as (a, b, c):
        a.send("c", "params", 0, [np.ones(4, np.float32)])  # a's route back to c is open
        got = c.recv(HANG_S, {"params"})
        assert got is not None and got.sender == "a"
        burst = 1000  # (more than the ROUTER is read in one turn)
        for round in range(burst):
            for sender in (b, c):
                sender.send("a", "params", round, [np.full(4, round, np.float32)])
        rounds: list[int] = []
        senders: set[str] = set()

        def all_came() -> bool:
            while (message := a.recv(0.1, {"params"})) is not None:
                assert message.tensors[0][0] == message.round
                rounds.append(message.round)
                senders.add(message.sender)
            # (a full queue drops at the senders; a reader that fell behind, the oldest at a)
            dropped = sum(p.stats.dropped.total() for p in (a, b, c))
            return len(rounds) + dropped >= 2 * burst or bool(a.stats.rejected)

        assert wait_until(all_came)
        assert a.stats.rejected == {}
        assert senders == {"b", "c"}


def test_a_trusted_key_claiming_the_id_of_a_member_behind_nat_does_not_get_its_messages(
    tmp_path: Path,
) -> None:
    """Routes are kept per id *and* key: an insider that speaks as "c" under its own key gets a
    route of its own, which a message to the member c (sent with c's key) never takes."""
    trusted = make_keys(tmp_path, "a", "c", "m")
    listen = addresses(1)
    a = Peer("a", listen[0], curve=curve_for(tmp_path, "a", trusted))
    c = Peer("c", None, listen, curve=curve_for(tmp_path, "c", trusted))
    insider = Transport("c", None, curve=curve_for(tmp_path, "m", trusted), inbox_kinds={"params"})
    try:
        for endpoint in (a, c, insider):
            endpoint.start()
        for peer in (a, c):
            peer.wait_ready(HANG_S, expect=2)

        def insider_heard() -> bool:  # the insider is heard last, its route the freshest
            insider.send(listen[0], "params", 0, [np.zeros(2, np.float32)], key=_public(a), member=True)
            return a.stats.rejected["key_mismatch"] >= 3  # (c's record has c's key)

        # (sent until heard: what is sent on a connection whose handshake a loaded machine keeps
        # past HANDSHAKE_S is dropped, as it should be)
        assert wait_until(insider_heard, interval=0.1)
        a.send("c", "params", 9, [np.ones(2, np.float32)])
        got = c.recv(10, {"params"})
        assert got is not None and (got.sender, got.round) == ("a", 9)
        assert insider.recv(1.0) is None
    finally:
        for endpoint in (a, c, insider):
            endpoint.close()


def _public(peer: Peer) -> str:
    assert peer.transport.curve is not None
    return peer.transport.curve.keys.public.decode()


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({}, "joins through --bootstrap"),
        ({"beacon": "7400"}, "drop --beacon"),
        ({"advertise": "tcp://10.0.0.9:7000"}, "no address to --advertise"),
        ({"local_ranks": "2"}, "local ranks are dialed"),
    ],
)
def test_a_node_that_does_not_listen_needs_a_bootstrap_and_nothing_that_dials_it(
    values: dict[str, str], problem: str
) -> None:
    bootstrap = {"bootstrap": ["tcp://10.0.0.1:7000"]} if values else {}
    with pytest.raises(ConfigError, match=f"--no-listen: .*{problem}"):
        load(NodeConfig, {"no_listen": "true", "insecure": "true", **bootstrap, **values})
    with pytest.raises(ConfigError, match=r"--no-listen: rank 4 is not in 1\.\.3 \(rank 0 is every"):
        load(MeshConfig, {"nodes": "4", "no_listen": ["4"]})
    with pytest.raises(TransportError, match="only join through bootstrap="):
        Peer("c", None)


def test_the_graph_pairs_members_that_do_not_listen_only_with_members_that_do() -> None:
    """On a ring of 6 where 1, 2 and 3 do not listen, 1-2 and 2-3 are replaced by edges to
    members that listen; weights still sum to 1 and every member still has a neighbour."""
    members = [f"n{i}" for i in range(6)]
    hidden = frozenset({"n1", "n2", "n3"})
    rows = {m: mixing_row(Topology("ring"), members, m, 0, hidden) for m in members}
    for me, row in rows.items():
        assert row.receive_from, me
        assert abs(row.self_weight + sum(row.receive_from.values()) - 1) < 1e-12
        if me in hidden:
            assert not set(row.receive_from) & hidden, (me, row.receive_from)
        for other in row.receive_from:
            assert me in rows[other].receive_from  # symmetric
