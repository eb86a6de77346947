"""Membership: merge rules, and real peers in one process (joining, crash detection, leave)."""

from __future__ import annotations

import time

import pytest
from helpers import HANG_S, addresses, started_peers, wait_until

from p2p import Peer, TransportError
from p2p.membership.protocol import NOT_YET, PROFILES, Membership
from p2p.membership.table import Member, MemberTable, Status, refuted

A = "tcp://127.0.0.1:7001"


def member(status: Status = Status.ALIVE, incarnation: int = 0, session: int = 1, **rounds: int) -> Member:
    return Member("n1", A, session, incarnation, status, **rounds)


def test_suspicion_needs_a_higher_incarnation_to_clear() -> None:
    table = MemberTable()
    assert table.apply(member(), 0).event == "joined"
    assert table.apply(member(Status.SUSPECT), 1).event == "suspected"
    assert table.apply(member(Status.ALIVE, 0), 2) is None  # stale alive cannot clear it
    assert table.apply(member(Status.ALIVE, 1), 3).event == "alive"  # the refutation can
    assert table.apply(member(Status.SUSPECT, 0), 4) is None  # old suspicion of an older incarnation


def test_the_dead_stay_dead_and_a_restart_is_a_new_life() -> None:
    table = MemberTable()
    table.apply(member(), 0)
    assert table.apply(member(Status.DEAD), 1).event == "dead"
    assert table.apply(member(Status.ALIVE, 5), 2) is None  # tombstone: no resurrection by gossip
    assert table.apply(member(Status.SUSPECT, 9), 3) is None
    rejoined = table.apply(member(Status.ALIVE, 0, session=2), 4)  # same id, new process
    assert rejoined is not None and rejoined.event == "joined"
    assert table.apply(member(Status.ALIVE, 3, session=1), 5) is None  # old life stays dead


def test_left_is_final_and_keeps_its_last_round() -> None:
    table = MemberTable()
    table.apply(member(), 0)
    change = table.apply(member(Status.LEFT, 1, last_round=41), 1)
    assert change is not None and change.event == "left" and change.member.last_round == 41
    assert table.apply(member(Status.ALIVE, 7), 2) is None
    assert table.live() == []


def test_record_changes_without_status_change_are_changes_without_events() -> None:
    table = MemberTable()
    table.apply(member(first_round=2**62), 0)
    change = table.apply(member(Status.ALIVE, 1, first_round=120), 1)  # a joiner announcing its start
    assert change is not None and change.event is None and change.member.first_round == 120


def test_tombstones_expire() -> None:
    table = MemberTable()
    table.apply(member(), 0)
    table.apply(member(Status.DEAD), 1)
    assert table.forget_ended(30, after_s=60) == []
    assert [m.id for m in table.forget_ended(62, after_s=60)] == ["n1"]
    assert table.apply(member(Status.ALIVE, 9), 63).event == "joined"


def test_refutation() -> None:
    me = member(incarnation=3)
    assert refuted(me, member(Status.SUSPECT, 3)).incarnation == 4
    assert refuted(me, member(Status.SUSPECT, 2)) is None  # already refuted
    assert refuted(me, member(Status.SUSPECT, 3, session=9)) is None  # about a previous life
    reborn = refuted(me, member(Status.DEAD, 3))
    assert reborn is not None and reborn.session != me.session and reborn.incarnation == 0


@pytest.mark.parametrize(
    "raw",
    [
        "x",
        ["n1", A, 1, 0, "alive", 0],
        ["bad id!", A, 1, 0, "alive", 0, -1],
        ["n1", "nowhere", 1, 0, "alive", 0, -1],
        ["n1", A, -1, 0, "alive", 0, -1],
        ["n1", A, 1, 0, "zombie", 0, -1],
        ["n1", A, 1, 0, "alive", -2, -1],
        ["n1", A, 1, True, "alive", 0, -1],
    ],
)
def test_malformed_updates_are_refused(raw: object) -> None:
    with pytest.raises(ValueError):
        Member.from_wire(raw)


def test_suspicion_timeout_follows_memberlist() -> None:
    local = PROFILES["local"]
    assert local.suspicion_timeout_s(8) == pytest.approx(3.0)  # 3 x max(1, log10 8) x 1 s
    assert local.suspicion_timeout_s(100) == pytest.approx(6.0)
    assert local.transmissions(8) == 4


def test_eight_peers_assemble_from_one_bootstrap_address() -> None:
    with started_peers([f"node-{i}" for i in range(8)]) as peers:
        assert all(len(p.members()) == 8 for p in peers)
        assert all(p.bootstrap == [peers[0].address] for p in peers[1:])


def test_a_crashed_peer_is_declared_dead_by_everyone_and_a_leaver_at_once() -> None:
    with started_peers([f"node-{i}" for i in range(6)]) as peers:
        victim, leaver, survivors = peers[5], peers[4], peers[:4]
        crashed = time.monotonic()
        victim.transport.close()  # a crash: no leave message
        assert wait_until(lambda: all("node-5" not in p.members() for p in survivors))
        profile = PROFILES["local"]  # a probe within two intervals, then the suspicion timeout
        bound = 2 * profile.probe_interval_s + profile.suspicion_timeout_s(6) + 1.0
        for peer in survivors:
            events = [e for e in peer.membership.events if e["node"] == "node-5"]
            assert [e["event"] for e in events[-2:]] == ["suspected", "dead"], events
            assert events[-1]["t"] - crashed < bound, (events, crashed)  # the network thread's time
        leaver.leave(after_round=17)  # it still answers probes: only its leave message removes it
        assert wait_until(lambda: all("node-4" not in p.members() for p in survivors))
        for peer in survivors:  # removed by its leave, not declared dead
            assert [e["event"] for e in peer.membership.events if e["node"] == "node-4"][-1] == "left"
        assert all("node-4" in p.members(17) and "node-4" not in p.members(18) for p in survivors)


def test_a_node_with_no_bootstrap_is_a_mesh_of_one_that_others_join() -> None:
    lonely = Peer("solo", "tcp://127.0.0.1:0")
    lonely.start()
    try:
        lonely.wait_ready(HANG_S)
        assert lonely.members() == {"solo"}
        other = Peer("later", "tcp://127.0.0.1:0", [f"localhost:{lonely.address.rsplit(':', 1)[1]}"])
        other.start()  # a DNS name works as a bootstrap address
        other.wait_ready(HANG_S, expect=2)
        assert wait_until(lambda: lonely.members() == {"solo", "later"})
        other.close()
    finally:
        lonely.close()


def test_idle_membership_does_not_spin() -> None:
    """An idle pair must sleep between timers (a spinning network thread starves training)."""
    ticks = {"n": 0}
    with started_peers(["a", "b"]) as (a, _):
        membership: Membership = a.membership
        original = membership.on_tick

        def counted(now: float) -> float:
            ticks["n"] += 1
            return original(now)

        membership.on_tick = counted  # type: ignore[method-assign]
        time.sleep(1.0)
    assert ticks["n"] < 60  # gossip every 0.1 s, probes every 1 s: a few dozen ticks a second


def test_joiner_waits_for_its_first_round() -> None:
    with started_peers(["a", "b"]) as (a, b):
        late = Peer("c", addresses(1)[0], [a.address], first_round=2**62)
        late.start()
        try:
            late.wait_ready(HANG_S, expect=3)
            assert wait_until(lambda: "c" in a.members())
            assert "c" not in a.members(100)  # a member, but in no round yet
            late.transport.call_soon(lambda: time.sleep(0.3))  # a busy network thread...
            late.start_at_round(40)
            assert "c" in late.members(40)  # ...yet at once: its first round may follow right away
            assert wait_until(lambda: "c" in b.members(40))
            assert "c" not in b.members(39)
        finally:
            late.close()


def test_members_starting_together_wait_at_round_zero_for_the_slowest() -> None:
    """A member counts for round 0 only once it says it is ready to train, so a node seconds
    slower to start (imports, data) is waited for instead of averaged around."""
    first = Peer("a", addresses(1)[0], first_round=NOT_YET)
    first.start()
    slow = Peer("b", addresses(1)[0], [first.address], first_round=NOT_YET)
    slow.start()
    try:
        first.wait_ready(HANG_S, expect=2)
        first.start_at_round(0)
        not_ready = "only 1 of the 2 expected members were ready to train round 0"
        with pytest.raises(TransportError, match=not_ready):
            first.wait_ready(0.5, expect=2, round=0)
        # a joiner's wait names no round (it waits for those that announced any first round)
        with pytest.raises(
            TransportError, match="only 1 of the 2 expected members were ready to train within"
        ):
            first.wait_ready(0.5, expect=2, round=NOT_YET - 1)
        slow.start_at_round(0)
        first.wait_ready(HANG_S, expect=2, round=0)
        assert first.members(0) == {"a", "b"}
    finally:
        slow.close()
        first.close()
