"""The averaging algorithms' math and bounds, over the in-memory network (the real algorithm
code, no sockets): exact averages, staleness bounds, backup neighbours."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import HANG_S, average_in_threads, wait_until

from gossip import ADPSGD, DPSGD, SGP, Algorithm, IncompatibleOptionsError, RobustRule, consensus_distance
from gossip.algorithms import adpsgd as adpsgd_module
from gossip.algorithms.averager import RoundStats
from gossip.algorithms.pace import Pace
from gossip.buffers import vector as vector_module
from gossip.buffers.vector import Layout
from gossip.messages import PAIR_ASK, PAIR_DIFFERENCE, PAIR_MODEL, PAIR_TURN, Exchange
from gossipmesh.sim.memory import MemoryNetwork
from p2p.wire import Message
from topologies import SpecError, Topology


def memory_mesh(n: int) -> list:  # type: ignore[type-arg]
    network = MemoryNetwork()
    return [network.join(f"node-{i}") for i in range(n)]


def start_vectors(n: int, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(200) + 2.0 for _ in range(n)]


def exchange_until(
    vectors: list[np.ndarray], done: Callable[[list[ADPSGD]], bool], **options: Any
) -> list[ADPSGD]:
    """AD-PSGD on a ring of in-memory nodes holding ``vectors``, until ``done`` (asserted)."""
    averagers = [
        ADPSGD(p, v, topology=Topology.parse("ring"), interval_s=0.001, **options)
        for p, v in zip(memory_mesh(len(vectors)), vectors, strict=True)
    ]
    try:
        assert wait_until(lambda: done(averagers))
    finally:
        for averager in averagers:
            averager.close()
    return averagers


def test_push_sum_reaches_the_exact_mean_in_log2_n_rounds_on_one_peer_exponential() -> None:
    vectors = start_vectors(8)
    target = np.mean(vectors, axis=0)
    average_in_threads(
        memory_mesh(8), vectors, topology="one-peer-exponential", rounds=3, algorithm="sgp:overlap=0"
    )
    for vector in vectors:
        np.testing.assert_allclose(vector, target, atol=1e-12)


def test_a_push_sum_node_that_hears_nothing_for_a_thousand_rounds_keeps_its_model() -> None:
    """Its weight halves every round it pushes and receives nothing (its in-neighbour stopped):
    a float32 numerator x = w z reached 0/0 after about 150 rounds. Its model stays exact, and
    the first share it hears again is mixed in by weight."""
    lonely, silent = memory_mesh(2)
    model = np.linspace(-1.0, 1.0, 41, dtype=np.float32)
    start = model.copy()
    sgp = SGP(lonely, model, topology=Topology.parse("ring"), round_timeout=0.0005)
    for _ in range(1100):
        sgp.after_step()
    np.testing.assert_array_equal(model, start)
    assert 0.0 < sgp.weight < 1e-300
    silent.send(
        "node-0", "push", sgp.round, [np.full(41, 5.0, np.float32)], {"starts": [0], "weights": [0.5]}
    )
    sgp.after_step()
    np.testing.assert_allclose(model, 5.0, rtol=1e-6)  # its own weight is nothing beside 0.5


def test_every_exact_every_th_dpsgd_round_averages_all_members_exactly() -> None:
    vectors = start_vectors(8, seed=6)
    target = np.mean(vectors, axis=0)
    history: list[list[np.ndarray]] = [[] for _ in vectors]
    average_in_threads(
        memory_mesh(8), vectors, topology="ring", rounds=6, algorithm="dpsgd:exact_every=3", history=history
    )
    gaps = [consensus_distance([h[r] for h in history]) for r in range(6)]
    assert gaps[1] > 0.05 and gaps[0] > gaps[1]  # two ring rounds: far from consensus...
    assert gaps[2] < 1e-12 and gaps[5] < 1e-12  # ...the third round of each three is exact
    for vector in vectors:
        np.testing.assert_allclose(vector, target, atol=1e-12)


def test_push_sum_with_overlap_converges_to_the_exact_mean_on_a_directed_graph() -> None:
    vectors = start_vectors(8, seed=4)
    target = np.mean(vectors, axis=0)
    average_in_threads(memory_mesh(8), vectors, topology="directed-exponential", rounds=60, algorithm="sgp")
    for vector in vectors:
        np.testing.assert_allclose(vector, target, atol=1e-6)


def test_asynchronous_pairwise_averaging_keeps_the_mean_and_reaches_it() -> None:
    vectors = start_vectors(8, seed=5)
    target = np.mean(vectors, axis=0)
    averagers = exchange_until(vectors, lambda _: consensus_distance(vectors) < 1e-9)
    np.testing.assert_allclose(np.mean(vectors, axis=0), target, atol=1e-12)  # exchanges are atomic pairs
    for vector in vectors:
        np.testing.assert_allclose(vector, target, atol=1e-6)
    actives = [
        a for a in averagers if a.exchanges and a.peer.node_id in {"node-0", "node-2", "node-4", "node-6"}
    ]
    assert len(actives) == 4


def test_asynchronous_exchanges_keep_every_local_step_taken_while_they_wait() -> None:
    """Four nodes "train" (add 1 to every value, under the lock) while they exchange; once they
    stop and agree, the mean must have gained exactly what the steps added. An active node that
    took the mean of its model *now* and its partner's answer kept only half of the steps it
    took while waiting for the answer."""
    peers = memory_mesh(4)
    vectors = start_vectors(4, seed=8)
    start_mean = np.mean(vectors, axis=0)
    locks = [threading.Lock() for _ in peers]
    averagers = [
        ADPSGD(p, v, topology=Topology.parse("ring"), interval_s=0.0005, lock=lock)
        for p, v, lock in zip(peers, vectors, locks, strict=True)
    ]
    steps = 300

    def train(vector: np.ndarray, lock: threading.Lock, averager: ADPSGD) -> None:
        for _ in range(steps):
            with lock:
                vector += 1.0
            averager.after_step()
            time.sleep(0.0002)

    trainers = [
        threading.Thread(target=train, args=args) for args in zip(vectors, locks, averagers, strict=True)
    ]
    try:
        for trainer in trainers:
            trainer.start()
        for trainer in trainers:
            trainer.join()
        assert wait_until(lambda: consensus_distance(vectors) < 1e-12)
    finally:
        for averager in averagers:
            averager.close()
    assert sum(a.exchanges for a in averagers) > 200  # (exchanges did overlap the steps)
    np.testing.assert_allclose(np.mean(vectors, axis=0), start_mean + steps, rtol=0, atol=1e-9)


def test_asynchronous_exchanges_over_a_narrow_wire_keep_the_mean_to_the_vectors_rounding() -> None:
    """Half of each model goes on the wire in bfloat16. The passive answers with half the
    difference as sent and moves by exactly that, so the pair's sum is kept to float32's
    rounding, not bfloat16's (an answer of the passive's model, rounded, would move the
    mean by ~1e-3 an exchange)."""
    vectors = [vector.astype(np.float32) for vector in start_vectors(4, seed=11)]
    target = np.mean(np.array(vectors, dtype=np.float64), axis=0)
    spread = consensus_distance(vectors)
    layout = Layout(((vector_module.BFLOAT16, 100), (np.dtype(np.float32), 100)))
    exchange_until(vectors, lambda averagers: sum(a.exchanges for a in averagers) >= 100, layout=layout)
    mean = np.mean(np.array(vectors, dtype=np.float64), axis=0)
    np.testing.assert_allclose(mean, target, rtol=0, atol=2e-5)
    assert consensus_distance(vectors) < 0.1 * spread  # (and they did average)


def test_asynchronous_exchanges_of_a_large_model_take_turns_at_each_passive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Above ``ASK_ABOVE_BYTES`` an active asks for a turn first and a passive answers one
    request at a time: the mean is kept and reached as without turns, and a request sent
    without a turn is refused, the passive's model untouched."""
    monkeypatch.setattr(adpsgd_module, "ASK_ABOVE_BYTES", 0)  # (every model "large")
    vectors = start_vectors(4, seed=12)
    target = np.mean(vectors, axis=0)
    averagers = exchange_until(vectors, lambda _: consensus_distance(vectors) < 1e-9)
    np.testing.assert_allclose(np.mean(vectors, axis=0), target, atol=1e-12)
    assert sum(a.dropped["pair_without_turn"] for a in averagers) == 0


def test_a_passive_gives_one_turn_at_a_time_and_a_new_ask_ends_its_askers_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Served by hand (its exchanger stopped): the first ask gets the turn, the second waits;
    a request without the turn is refused and leaves the model as it was; the turn's holder
    asking again (it gave its exchange up) goes behind the one waiting, and gets its turn once
    that one's answer has left; with no one else asking, it gets the new turn at once."""
    monkeypatch.setattr(adpsgd_module, "ASK_ABOVE_BYTES", 0)
    a, passive_peer, b = memory_mesh(3)
    passive = ADPSGD(passive_peer, own := np.ones(3), topology=Topology.parse("ring"))
    passive.close()

    def serve(kind: str, sender: str, exchange: int, tensors: tuple[np.ndarray, ...] = ()) -> None:
        passive._serve(Message(kind, sender, 0, tensors, Exchange(exchange).encode()))

    def turns(peer: Any) -> list[int]:
        got = []
        while (message := peer.recv(0.01, (PAIR_TURN,))) is not None:
            got.append(Exchange.decode(message.meta).exchange)
        return got

    serve(PAIR_ASK, "node-0", 1)
    serve(PAIR_ASK, "node-2", 1)
    assert turns(a) == [1] and turns(b) == []
    serve(PAIR_MODEL, "node-2", 1, (np.full(3, 5.0),))
    assert passive.dropped["pair_without_turn"] == 1 and np.array_equal(own, np.ones(3))
    serve(PAIR_ASK, "node-0", 2)  # (node-0 gave exchange 1 up: node-2 asked first)
    assert turns(a) == [] and turns(b) == [1] and passive.dropped["pair_turn_unused"] == 1
    serve(PAIR_MODEL, "node-0", 1, (np.full(3, 5.0),))
    assert passive.dropped["pair_without_turn"] == 2 and np.array_equal(own, np.ones(3))
    leaving = {"node-2": 1}  # (the answer to node-2 has not left yet)
    monkeypatch.setattr(passive_peer, "backlog", lambda to: leaving.get(to, 0))
    serve(PAIR_MODEL, "node-2", 1, (np.full(3, 5.0),))
    np.testing.assert_array_equal(own, np.full(3, 3.0))  # the mean
    answer = b.recv(0.01, (PAIR_DIFFERENCE,))
    assert answer is not None and Exchange.decode(answer.meta).exchange == 1
    np.testing.assert_array_equal(answer.tensors[0], np.full(3, -2.0))  # (1 - 5) / 2
    assert turns(a) == []  # one model's bytes at a time: node-0 waits for the answer to leave
    leaving.clear()
    passive._give_turn()
    assert turns(a) == [2]
    serve(PAIR_ASK, "node-0", 3)  # (no one else asks: the new turn at once)
    assert turns(a) == [3] and passive.dropped["pair_turn_unused"] == 2


def test_dpsgd_drops_messages_beyond_the_staleness_bound_and_discounts_the_others() -> None:
    a, b = memory_mesh(2)
    own = np.full(3, 1.0)
    averager = DPSGD(a, own, topology=Topology.parse("ring"), round_timeout=0.2, max_staleness=1)
    averager.round = 3
    b.send("node-0", "params", 1, [np.full(3, 9.0)])  # two rounds old: beyond the bound
    b.send("node-0", "params", 2, [np.full(3, 5.0)])  # one round old: mixed in, discounted
    stats = averager.average()
    assert averager.dropped["stale"] == 1
    assert stats.arrived == 1 and averager.staleness.max == 1
    # ring of 2: weight 1/2 for the neighbour, halved again for being one round old
    np.testing.assert_allclose(own, 0.75 * 1.0 + 0.25 * 5.0)


def test_dpsgd_with_backup_neighbours_does_not_wait_for_the_last_one() -> None:
    a, b, _ = memory_mesh(3)
    own = np.full(2, 1.0)
    averager = DPSGD(a, own, topology=Topology.parse("complete"), round_timeout=5.0, backup=1)
    b.send("node-0", "params", 0, [np.full(2, 3.0)])
    started = time.monotonic()
    stats = averager.average()
    assert time.monotonic() - started < 5.0  # node-2 is silent, and its round timeout not waited out
    assert (stats.expected, stats.arrived) == (2, 1)
    np.testing.assert_allclose(own, 2.0)  # 1/3 and 1/3, renormalised over what came


def test_dpsgd_that_fell_behind_catches_up_to_its_neighbours_round() -> None:
    """A straggler (backup workers left it behind) that hears a neighbour 3 rounds ahead skips
    to the round after the newest it heard, dropping the values of the rounds it skipped, and
    mixes the neighbour's value of that round; without catch_up it works through old rounds."""
    for catch_up, mixed_round, value in ((3, 11, (5.5 + 21) / 2), (0, 1, (5.5 + 11) / 2)):
        a, b = memory_mesh(2)
        own = np.full(2, 1.0)
        averager = DPSGD(a, own, topology=Topology.parse("ring"), round_timeout=5.0, catch_up=catch_up)
        for r in range(11):
            b.send("node-0", "params", r, [np.full(2, 10.0 + r)])
        averager.average()  # round 0 mixes 10.0 into 1.0; the others wait as early values
        b.send("node-0", "params", 11, [np.full(2, 21.0)])  # the neighbour's next round
        stats = averager.average()
        assert stats.round == mixed_round and stats.arrived == 1
        np.testing.assert_allclose(own, value)
        assert averager.pace.rounds_skipped == (10 if catch_up else 0)


def behind_a_neighbour_at_round_10() -> tuple[MemoryNetwork, DPSGD, np.ndarray]:
    """node-0 after its round 0 (10.0 mixed into 1.0: 5.5), its ring neighbour node-1's
    values of rounds 1-10 (11.0-20.0) in, kept as early values."""
    network = MemoryNetwork()
    a, b = network.join("node-0"), network.join("node-1")
    own = np.full(2, 1.0)
    averager = DPSGD(a, own, topology=Topology.parse("ring"), round_timeout=30.0, catch_up=3)
    for r in range(11):
        b.send("node-0", "params", r, [np.full(2, 10.0 + r)])
    averager.average()
    return network, averager, own


def test_a_straggler_whose_neighbour_left_skips_to_its_last_round_and_mixes_it() -> None:
    """A neighbour whose step budget ended after round 10 (it left after it) takes part in no
    later round: the straggler skips to round 10, whose value is here, not to 11, which would
    mix nothing and drop that value."""
    network, averager, own = behind_a_neighbour_at_round_10()
    network.leave("node-1", after_round=10)
    stats = averager.average()
    assert stats.round == 10 and stats.arrived == 1
    np.testing.assert_allclose(own, (5.5 + 20) / 2)
    assert averager.pace.rounds_skipped == 9


def test_a_straggler_skips_no_further_than_the_round_its_step_budget_ends_at() -> None:
    """With its budget ending at round 5 (``skip_limit``, from the optimizer), a straggler whose
    neighbour is at round 10 skips to 5, where it mixes that round's value, not to 11."""
    _, averager, own = behind_a_neighbour_at_round_10()
    averager.skip_limit = 5
    stats = averager.average()
    assert stats.round == 5 and averager.pace.rounds_skipped == 4
    np.testing.assert_allclose(own, (5.5 + 15.0) / 2)


def test_a_straggler_that_skipped_past_a_leaving_neighbours_last_round_mixes_it_late() -> None:
    """Where the leave comes after the skip was decided (to round 11, after the neighbour's
    newest), the neighbour's value of round 10 is mixed late, discounted, rather than none."""
    network, averager, own = behind_a_neighbour_at_round_10()
    leaving = threading.Timer(0.1, lambda: network.leave("node-1", after_round=10))
    leaving.start()  # (while round 11 waits for its value: the wait ends with the leave)
    stats = averager.average()
    leaving.join()
    assert stats.round == 11 and stats.arrived == 1
    # its weight 1/2 halved for a round late, the row renormalised over what came: 1/3
    np.testing.assert_allclose(own, (2 * 5.5 + 20.0) / 3)


@pytest.mark.parametrize("algorithm", ["dpsgd", "sgp", "choco", "adpsgd"])
def test_the_final_exchange_mixes_every_neighbours_final_model_and_waits_for_none_that_left(
    algorithm: str,
) -> None:
    """Every algorithm ends the same way: on a complete graph of 3 the final exchange takes
    each node to the mean of the three models (3.0 unless adpsgd exchanged a pair before it
    stopped), whatever rounds they are at; a neighbour that
    left without a final model is not waited for (its absence ends the wait, not the bound)."""
    network = MemoryNetwork()
    peers = [network.join(f"node-{i}") for i in range(3)]
    vectors = [np.full(4, v, dtype=np.float32) for v in (1.0, 2.0, 6.0)]
    averagers = [
        Algorithm.parse(algorithm).build(
            peer, vector, topology=Topology.parse("complete"), round_timeout=5.0, lock=None
        )
        for peer, vector in zip(peers, vectors, strict=True)
    ]
    for averager in averagers:
        averager.close()  # (background exchanges stop first, as GossipOptimizer.finish does)
    mean = np.mean(vectors, axis=0)  # (adpsgd's may have exchanged a pair by now)
    averagers[2].round = 7  # (a node rounds ahead: the exchange is outside the rounds)
    finals: dict[int, RoundStats] = {}

    def finish(i: int) -> None:
        finals[i] = averagers[i].finish(wait_s=HANG_S)

    threads = [threading.Thread(target=finish, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for vector in vectors:
        np.testing.assert_allclose(vector, mean, rtol=1e-6)
    assert [(finals[i].expected, finals[i].arrived) for i in range(3)] == [(2, 2)] * 3
    network.leave("node-2")
    leaving = threading.Timer(0.1, lambda: network.leave("node-1"))
    leaving.start()  # (while node-0 waits for a final model node-1 never sends)
    again = averagers[0].finish(wait_s=HANG_S / 10)
    leaving.join()
    assert (again.expected, again.arrived) == (1, 0)
    assert again.wait_s < HANG_S / 20  # the leave ended the wait (in ~0.1 s), not the bound


def test_with_a_robust_rule_there_is_no_final_exchange() -> None:
    """A plain final mix would let an insider's model past the robust rounds: none is made."""
    a, b = memory_mesh(2)
    own = np.full(2, 1.0, dtype=np.float32)
    averager = Algorithm.parse("dpsgd").build(
        a, own, topology=Topology.parse("ring"), round_timeout=5.0, lock=None,
        robust=RobustRule.parse("trimmed-mean"),
    )  # fmt: skip
    b.send("node-0", "final", 0, [np.full(2, 1e6, dtype=np.float32)])
    final = averager.finish(wait_s=HANG_S)
    assert (final.expected, final.arrived) == (0, 0)
    np.testing.assert_array_equal(own, 1.0)


def test_one_neighbour_naming_a_round_far_ahead_does_not_throw_a_node_forward() -> None:
    """Catching up goes by the median of the neighbours' newest rounds: a liar at round 10^9
    beside an honest neighbour at round 1 moves nothing."""
    a, liar, honest = memory_mesh(3)
    own = np.full(2, 1.0)
    averager = DPSGD(a, own, topology=Topology.parse("ring"), round_timeout=0.2, backup=1, catch_up=2)
    liar.send("node-0", "params", 10**9, [np.full(2, 5.0)])
    for r in range(3):
        honest.send("node-0", "params", r, [np.full(2, 3.0)])
        averager.average()
    assert averager.round == 3 and averager.pace.rounds_skipped == 0


class SendsWhileWaitedFor:
    """A node's network on which ``send`` runs (a neighbour's message) the first time the node
    waits for a message (a receive with a timeout) once ``armed``."""

    def __init__(self, peer: Any, send: Callable[[], None]) -> None:
        self._peer, self._send = peer, send
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._peer, name)

    def recv(self, timeout: float, kinds: Any) -> Any:
        if self.armed and timeout > 0:
            self.armed = False
            self._send()
        return self._peer.recv(timeout, kinds)


@pytest.mark.parametrize("catch_up", [2, 0])
def test_a_node_ahead_of_every_neighbour_waits_for_them_and_mixes_what_they_send(catch_up: int) -> None:
    """A neighbour whose value of round 2 did not come is silent, not waited for: the node runs
    on alone. Once it is more than ``catch_up`` rounds ahead of every neighbour (round 4, the
    neighbour's newest value of round 1) its round waits for them, and mixes the value of round 3
    that comes meanwhile (late by one: its weight halved); without catch_up the round ends at
    once, mixing nothing."""
    a, b = memory_mesh(2)
    network = SendsWhileWaitedFor(a, lambda: b.send("node-0", "params", 3, [np.full(2, 11.0)]))
    own = np.full(2, 1.0)
    averager = DPSGD(network, own, topology=Topology.parse("ring"), round_timeout=0.2, catch_up=catch_up)
    for r in range(2):
        b.send("node-0", "params", r, [np.full(2, 3.0)])
        averager.average()
    assert averager.average().arrived == 0  # round 2: the neighbour's value does not come
    assert averager.average().arrived == 0  # round 3: not waited for, 2 rounds ahead of it
    np.testing.assert_allclose(own, 2.5)
    network.armed = True
    stats = averager.average()
    assert stats.round == 4 and stats.arrived == (1 if catch_up else 0)
    np.testing.assert_allclose(own, (2 * 2.5 + 11.0) / 3 if catch_up else 2.5)


def paced_rounds(pace: Pace, rounds: range, lags: dict[str, float], step_s: float = 0.02) -> None:
    """Rounds of a node taking ``step_s`` steps whose neighbours' values come ``lags`` after its
    own (a clock of its own: round r is sent at r * 0.2 s)."""
    for r in rounds:
        sent = r * 0.2
        pace.mixed(sent - step_s)
        pace.sent(r, sent)
        for j, lag in lags.items():
            pace.arrived(j, r, sent + lag)


def test_a_neighbour_whose_values_come_consistently_late_is_not_waited_for_until_it_keeps_up() -> None:
    """Measured lags, not a timeout: a neighbour 140 ms behind nodes taking 20 ms steps is a
    straggler; jitter of a few ms is not; a straggler that keeps up again is waited for again,
    and a node told to wait passes no one over."""
    pace, waiting = Pace(tolerate=True, catch_up=0), Pace(tolerate=False, catch_up=0)
    neighbours = {"a", "b", "slow"}
    for p in (pace, waiting):
        paced_rounds(p, range(8), {"a": 0.002, "b": 0.009, "slow": 0.14})
    assert pace.stragglers(neighbours) == {"slow"} and waiting.stragglers(neighbours) == set()
    assert pace.age_bound("slow", now=7 * 0.2) >= 2  # its late values are mixed within this age
    paced_rounds(pace, range(8, 16), {"a": 0.002, "b": 0.009, "slow": 0.004})
    assert pace.stragglers(neighbours) == set()
    paced_rounds(pace, range(16, 24), {"a": 0.002, "slow": 0.03})  # a ring: one of two is slower
    assert pace.stragglers({"a", "slow"}) == set()  # 30 ms: less than 1.5 steps more than a's
    paced_rounds(pace, range(24, 32), {"a": 0.002, "slow": 0.08})
    assert pace.stragglers({"a", "slow"}) == {"slow"}
    assert pace.report() == {"stragglers_passed_over": 2}


def test_a_round_of_one_neighbour_tells_a_straggler_against_the_neighbours_of_other_rounds() -> None:
    """On a time-varying graph a round has one in-neighbour: its lag is told slow or not against
    every neighbour measured (the code before compared it with none and waited for each)."""
    pace = Pace(tolerate=True, catch_up=0)
    paced_rounds(pace, range(8), {"a": 0.002, "b": 0.009, "slow": 0.14})
    assert pace.stragglers({"slow"}) == {"slow"}
    assert pace.stragglers({"a"}) == pace.stragglers({"b"}) == set()
    pace.keep({"slow"})  # a and b left: no measure is left beside its own
    assert pace.stragglers({"slow"}) == set()


def test_a_neighbour_that_moves_on_without_its_values_is_no_measure_of_the_others_lag() -> None:
    """A neighbour whose values, when they come, are rounds ahead (a lag of 0: it holds most back
    and waits for no one) but not of the rounds it is waited for: each such round is a lag
    without end, and the ring's other neighbour, measured against it, is no straggler (the
    code before passed over that one, and the node waited for no one)."""
    pace = Pace(tolerate=True, catch_up=0)
    paced_rounds(pace, range(8), {"ring": 0.14})
    for r in range(8):
        pace.arrived("ahead", 100 + r, 1.6)
    assert pace.stragglers({"ahead", "ring"}) == {"ring"}  # (by the values that came)
    for r in range(8, 12):
        pace.not_in("ahead", r)
        pace.not_in("ring", r)  # (not moved on: only late)
    assert pace.stragglers({"ahead", "ring"}) == {"ahead"}


def test_a_tolerant_node_holds_a_value_back_from_a_neighbour_whose_link_still_carries_one() -> None:
    pace, waiting = Pace(tolerate=True, catch_up=0), Pace(tolerate=False, catch_up=0)
    backlog = {"a": 0, "slow": 1}.__getitem__
    assert pace.ready(("a", "slow"), backlog) == ["a"] and pace.sends_held == 1
    assert waiting.ready(("a", "slow"), backlog) == ["a", "slow"] and waiting.sends_held == 0


def test_overlapped_dpsgd_keeps_the_mean_and_contracts_at_the_delayed_rate() -> None:
    """Mixing last round's values in difference form: the mean is exact every round, and the
    consensus distance contracts at the largest root of z² = z - (1 - μ)/2 over W's
    eigenvalues μ != 1 (the one-round-delayed iteration with γ = 1/2)."""
    vectors = start_vectors(8, seed=6)
    target = np.mean(vectors, axis=0)
    history: list[list[np.ndarray]] = [[] for _ in vectors]
    average_in_threads(
        memory_mesh(8), vectors, topology="ring", rounds=60, algorithm="dpsgd:overlap=1", history=history
    )
    distances = []
    for r in range(60):
        at_round = [h[r] for h in history]
        np.testing.assert_allclose(np.mean(at_round, axis=0), target, atol=1e-12)
        distances.append(consensus_distance(at_round))
    measured = (distances[59] / distances[39]) ** (1 / 20)
    mu = np.linalg.eigvalsh(Topology.parse("ring").weights(8))[:-1]
    roots = np.concatenate([np.roots([1, -1, (1 - m) / 2]) for m in mu])
    assert measured == pytest.approx(np.abs(roots).max(), rel=0.01)  # 0.8904
    assert distances[59] < 1e-2 * distances[0]


def test_algorithm_names_and_parameters() -> None:
    assert str(Algorithm.parse("dpsgd:staleness=2,backup=1")) == "dpsgd:backup=1,staleness=2"
    assert Algorithm.parse("sgp").default_topology == Topology("one-peer-exponential")
    with pytest.raises(SpecError, match="unknown algorithm 'allreduce'; choose one of dpsgd, sgp, adpsgd"):
        Algorithm.parse("allreduce")
    takes = "overlap, stragglers, staleness"
    with pytest.raises(SpecError, match=re.escape(f"sgp: unknown parameter 'backup'; it takes: {takes}")):
        Algorithm.parse("sgp:backup=1")
    with pytest.raises(SpecError, match=re.escape("dpsgd: backup: must be >= 0, got -1")):
        Algorithm.parse("dpsgd:backup=-1")
    with pytest.raises(
        IncompatibleOptionsError, match="algorithm=adpsgd needs a static undirected topology="
    ):
        Algorithm.parse("adpsgd").build(
            memory_mesh(1)[0],
            np.zeros(2),
            topology=Topology.parse("one-peer-exponential"),
            round_timeout=1,
            lock=None,
        )


@pytest.mark.parametrize(
    ("stragglers", "expected"), [("tolerate", (1.0 + 4.0 / 2 + 7.0 / 2) / 2), ("wait", 1.0)]
)
def test_tolerant_dpsgd_mixes_neighbours_values_that_all_come_a_round_late(
    stragglers: str, expected: float
) -> None:
    """A node whose every neighbour is late (its downlink, or they, slower than its own steps):
    none is a straggler beside the others, yet their values count, each weight halved for being
    a round old; told to wait, it drops what came after the round it waited for."""
    a, b, c = memory_mesh(3)
    own = np.full(2, 1.0)
    averager = DPSGD(a, own, topology=Topology.parse("ring"), round_timeout=0.05, stragglers=stragglers)
    averager.average()  # round 0: nothing comes within its wait
    b.send("node-0", "params", 0, [np.full(2, 4.0)])
    c.send("node-0", "params", 0, [np.full(2, 7.0)])
    stats = averager.average()  # round 1 takes the round-0 values, or drops them
    assert stats.round == 1 and stats.arrived == (2 if stragglers == "tolerate" else 0)
    np.testing.assert_allclose(own, expected)
