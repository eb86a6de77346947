"""The simulator runs the real averaging code: pinned to a real ZeroMQ mesh, to real-time
asynchronous runs, and to the spectral predictions at 1,024 nodes; faults and seeds behave."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
import time
from collections.abc import Callable

import numpy as np
import pytest
from helpers import average_in_threads, started_peers

from gossip import ADPSGD, Algorithm, Codec, consensus_distance
from gossip.algorithms.adpsgd import ASK_ABOVE_BYTES
from gossipmesh.cli import parse_config
from gossipmesh.cli import simulate as simulate_command
from gossipmesh.config import SimulateConfig
from gossipmesh.sim.clock import VirtualClock
from gossipmesh.sim.links import Link, VirtualNetwork
from gossipmesh.sim.memory import MemoryNetwork
from gossipmesh.sim.run import SimResult, averaging, simulate, slowest_mode_vectors, start_vectors
from gossipmesh.sim.scenario import Compute, Crash, Scenario, Stragglers, split_in_halves
from node import main
from topologies import Topology, second_eigenvalue_modulus

BIG = 1024


def run(scenario: Scenario, algorithm: str, topology: str, vectors: np.ndarray | None = None) -> SimResult:
    spec = Algorithm.parse(algorithm)
    if vectors is None:
        vectors = start_vectors(scenario.nodes, scenario.seed)
    build = averaging(vectors, spec, Topology.parse(topology), scenario.round_timeout, Codec())
    return simulate(scenario, build, vectors[0].nbytes)


@pytest.mark.mesh
@pytest.mark.parametrize(
    ("algorithm", "topology"),
    # (sgp waits for every share, as the simulator's lockstep rounds do: by default it passes over
    # an in-neighbour measured to lag, which a loaded machine's scheduling can make one look)
    [("dpsgd", "exponential"), ("sgp:overlap=0,stragglers=wait", "one-peer-exponential")],
)
def test_synchronous_averaging_matches_a_real_zeromq_mesh(algorithm: str, topology: str) -> None:
    vectors = start_vectors(8, seed=11)
    ids = [f"node-{i}" for i in range(8)]
    real = [v.copy() for v in vectors]
    with started_peers(ids) as peers:
        average_in_threads(peers, real, topology=topology, rounds=6, algorithm=algorithm)
    scenario = Scenario(nodes=8, rounds=6, compute=Compute(0.05), link=Link(0.001, 1.25e9), seed=11)
    simulated = run(scenario, algorithm, topology, vectors).final
    error = max(float(np.abs(simulated[i] - v).max()) for i, v in zip(ids, real, strict=True))
    assert error < 1e-6
    assert consensus_distance(real) < 0.5 * consensus_distance(list(vectors))  # it did average


def test_a_simulation_is_a_function_of_its_seed_and_a_slow_link_slows_it() -> None:
    def points(seed: int) -> list[tuple[float, float, float]]:
        scenario = Scenario(
            nodes=16,
            rounds=8,
            compute=Compute(0.1, jitter=0.3, stragglers=Stragglers(0.25, 4)),
            link=Link(0.002, 1e8),
            links={("node-3", "node-4"): Link(0.05, 1e7)},  # one slow link
            loss=0.05,
            model_bytes=10_000_000,
            seed=seed,
        )
        result = run(scenario, "dpsgd", "exponential")
        return [(p.consensus_distance, p.virtual_time_s, p.bytes_per_node) for p in result.rounds]

    assert points(1) == points(1)
    assert points(1) != points(2)
    lockstep = Scenario(nodes=4, rounds=3, compute=Compute(0.1), links={("node-0", "node-1"): Link(0.05)})
    ends = [p.virtual_time_s for p in run(lockstep, "dpsgd", "ring").rounds]
    # node-1 waits for node-0's value 50 ms after node-0 sent it; node-0 only for node-1's:
    # round 0 ends at 0.1 + 0.05, round 1 when node-1's step sent at 0.15 + 0.1 arrives, round 2
    # when node-0's value sent at 0.25 + 0.1 reaches node-1
    assert ends == pytest.approx([0.15, 0.25, 0.40])


def _behind_a_slow_uplink(algorithm: str, topology: str) -> tuple[float, float]:
    """8 nodes taking 50 ms steps; node-0's uplink carries one 250 kB model in 250 ms, a fifth
    of what it sends. The consensus distance after 200 rounds, and how far the nodes ended from
    the mean they began with."""
    slow = {("node-0", f"node-{j}"): Link(0.001, 1e6) for j in range(1, 8)}
    scenario = Scenario(
        nodes=8,
        rounds=200,
        compute=Compute(0.05),
        link=Link(0.001, 1e9),
        links=slow,
        model_bytes=250_000,
        seed=3,
    )
    vectors = start_vectors(8, seed=3)
    result = run(scenario, algorithm, topology, vectors)
    final = np.array(list(result.final.values()))
    return result.rounds[-1].consensus_distance, float(np.abs(final - vectors.mean(axis=0)).max())


def test_sgp_keeps_the_shares_a_slow_uplink_cannot_carry_and_reaches_the_exact_average() -> None:
    """Queued behind the slow uplink, node-0's pushes arrived ever staler: after 200 rounds the
    consensus distance was 2.4e-3 and the nodes 0.12 from the true mean. Kept while a push is
    still leaving (push-sum stays exact), they are 1.8e-5 and 2.2e-5."""
    distance, error = _behind_a_slow_uplink("sgp", "one-peer-exponential")
    assert distance < 1e-4 and error < 1e-4


def test_tolerant_dpsgd_sends_a_slow_uplink_at_most_one_value_behind_the_one_leaving() -> None:
    """Its values queued, node-0's neighbours mixed them ever older, then not at: the ring's
    consensus distance after 200 rounds was 2.8e-8; held back, 7.6e-11."""
    distance, _ = _behind_a_slow_uplink("dpsgd:stragglers=tolerate", "ring")
    assert distance < 1e-9


def test_a_node_behind_a_slow_uplink_goes_on_alone_once_its_neighbours_have_left() -> None:
    """40 rounds of 50 ms; node-0's uplink carries a fifth of what it sends, so it ends long
    after the others, which leave after their last round as daemons do. Its uplink then drops
    what waited for them and its rounds, with no neighbour left, take a step each: it neither
    waits for nodes that are done nor for its uplink to carry values to them."""
    slow = {("node-0", f"node-{j}"): Link(0.001, 1e6) for j in range(1, 8)}
    scenario = Scenario(
        nodes=8, rounds=40, compute=Compute(0.05), link=Link(0.001, 1e9), links=slow, model_bytes=250_000
    )
    ends = run(scenario, "dpsgd", "exponential").step_ends
    others_done = max(ends[f"node-{j}"][-1] for j in range(1, 8))
    alone = [t for t in ends["node-0"] if t > others_done]
    assert len(alone) > 20  # (most of its rounds come after theirs)
    # the first: at most the value on its uplink as they left (0.25 s) and a step
    assert alone[0] - others_done <= 0.25 + 0.05 + 1e-9
    assert np.diff(alone) == pytest.approx(0.05)


def test_a_simulated_uplink_drops_what_waits_for_a_node_that_left() -> None:
    """Three 1 s messages queued on one uplink, to node-1, node-2, node-1: node-2 leaves while
    the first is on the link, so the third leaves 1 s sooner; nothing is sent to it after."""
    clock = VirtualClock()
    network = VirtualNetwork(clock, link=Link(0.0, 1000.0))
    arrived: dict[str, list[tuple[float, int]]] = {"node-1": [], "node-2": []}
    payload = np.zeros(125)  # 1,000 bytes: 1 s on the link

    def sender() -> None:
        peer = network.join("node-0")
        for round, to in enumerate(("node-1", "node-2", "node-1")):
            peer.send(to, "params", round, [payload])
        peer.compute(0.5)
        assert peer.backlog("node-2") == 0 and peer.backlog("node-1") == 2
        peer.send("node-2", "params", 3, [payload])
        assert peer.backlog("node-2") == 0
        peer.compute(3.0)

    def receiver(name: str) -> Callable[[], None]:
        peer = network.join(name)

        def main() -> None:
            while clock.now < 4.0:  # (a membership change ends a wait with None)
                if (message := peer.recv(4.0 - clock.now)) is not None:
                    arrived[name].append((clock.now, message.round))

        return main

    for name in ("node-1", "node-2"):
        clock.spawn(name, name, receiver(name))
    clock.spawn("node-0", "node-0", sender)
    clock.at(0.5, lambda: network.leave("node-2", after_round=-1))
    clock.run()
    assert arrived == {"node-1": [(1.0, 0), (2.0, 2)], "node-2": []}


def test_one_peer_exponential_reaches_the_exact_average_in_log2_n_rounds_at_1024_nodes() -> None:
    result = run(Scenario(nodes=BIG, rounds=10, link=Link(0.001)), "dpsgd", "one-peer-exponential")
    distances = [p.consensus_distance for p in result.rounds]
    assert distances[8] > 1e-3  # not before log2(1024) = 10 rounds
    assert distances[9] < 1e-12


@pytest.mark.parametrize(
    ("topology", "nodes", "rounds"),
    [("ring", BIG, 6), ("exponential", 256, 6), ("random-matching", BIG, 16)],  # bench/simulator.py: 1024
)
def test_measured_contraction_matches_the_spectral_prediction(topology: str, nodes: int, rounds: int) -> None:
    graph = Topology.parse(topology)
    expected = graph.family.expected_contraction
    if expected:  # a random schedule: its expected contraction, from a random start
        predicted, vectors, rel = expected(nodes), None, 0.10
    else:  # a fixed graph: |lambda_2| exactly, from its slowest mode
        weights = graph.weights(nodes)
        predicted, vectors, rel = second_eigenvalue_modulus(weights), slowest_mode_vectors(weights, 0), 1e-9
    result = run(Scenario(nodes=nodes, rounds=rounds, link=Link(0.001)), "dpsgd", topology, vectors)
    distances = [p.consensus_distance for p in result.rounds]
    first = rounds // 2  # past the transient, where the slowest mode dominates
    measured = (distances[-1] / distances[first]) ** (1 / (rounds - 1 - first))
    assert measured == pytest.approx(predicted, rel=rel)


def rate(distances: list[float], seconds: float) -> float:
    """Log-contraction of the consensus distance per second."""
    return -math.log(distances[-1] / distances[0]) / seconds


@pytest.mark.mesh
def test_asynchronous_averaging_contracts_per_second_as_in_real_time() -> None:
    interval, seconds, nodes = 0.05, 1.5, 8
    vectors = list(start_vectors(nodes, seed=3))
    network = MemoryNetwork()
    peers = [network.join(f"node-{i}") for i in range(nodes)]
    before = consensus_distance(vectors)
    averagers = [
        ADPSGD(p, v, topology=Topology.parse("ring"), interval_s=interval)
        for p, v in zip(peers, vectors, strict=True)
    ]
    time.sleep(seconds)
    after = consensus_distance(vectors)
    for averager in averagers:
        averager.close()
    # the seconds the exchanges made would take at their pace: on a loaded machine a node's
    # exchanger thread gets the CPU for fewer of them than the interval allows, which the
    # simulator (one exchange per interval) does not model
    started = np.mean([averager.exchanges for averager in averagers])
    real = rate([before, after], min(seconds, started * interval))
    steps = round(seconds / 0.1)
    simulated = []
    for seed in range(3):
        scenario = Scenario(nodes=nodes, rounds=steps, compute=Compute(0.1), link=Link(0.0002), seed=seed)
        start = start_vectors(nodes, seed)
        result = run(scenario, f"adpsgd:interval_ms={interval * 1000:g}", "ring", start)
        distances = [consensus_distance(list(start))] + [p.consensus_distance for p in result.rounds]
        simulated.append(rate(distances, steps * 0.1))
    assert float(np.mean(simulated)) == pytest.approx(real, rel=0.20), (simulated, real)


def test_survivors_reach_consensus_after_a_crash_and_a_joiner_takes_part() -> None:
    scenario = Scenario(
        nodes=16, rounds=60, compute=Compute(0.1), link=Link(0.001), crashes=(Crash(5, 0.15),), joins=(2.0,)
    )
    result = run(scenario, "dpsgd", "exponential")
    survivors = [v for node, v in result.final.items() if node != "node-5"]
    assert len(survivors) == 16  # 15 survivors and the joiner, node-16
    assert consensus_distance(survivors) < 1e-6
    assert consensus_distance([result.final["node-5"], survivors[0]]) > 1e-3  # it stopped averaging
    assert result.rounds[5].consensus_distance > 0  # recorded for the live nodes


def test_a_partition_holds_until_it_heals_and_a_lossy_mesh_still_agrees() -> None:
    split = split_in_halves(0.0, 100.0, 16)
    cut = Scenario(
        nodes=16, rounds=40, compute=Compute(0.1), link=Link(0.001), partitions=(split,), round_timeout=0.05
    )
    final = run(cut, "dpsgd", "exponential").final
    halves = [[v for node, v in final.items() if (node in split.side) == inside] for inside in (True, False)]
    assert all(consensus_distance(half) < 1e-9 for half in halves)
    assert consensus_distance(list(final.values())) > 1e-2
    healed = dataclasses.replace(cut, partitions=(split_in_halves(0.0, 1.0, 16),), loss=0.01)
    result = run(healed, "dpsgd", "exponential")
    assert result.rounds[-1].consensus_distance < 1e-9
    assert result.messages_lost > 0


def test_a_simulated_model_larger_than_its_vector_asks_for_turns_as_that_model_would() -> None:
    """A simulation's vectors stand for a model of ``model_bytes``: AD-PSGD asks for a turn
    before sending it where that model would (it decided from the vector's own bytes)."""
    nodes = {}
    for scale in (1.0, ASK_ABOVE_BYTES):
        clock = VirtualClock()
        network = VirtualNetwork(clock, byte_scale=scale)

        def main(network: VirtualNetwork = network, scale: float = scale) -> None:
            nodes[scale] = ADPSGD(network.join("node-0"), np.ones(8), topology=Topology.parse("ring"))

        clock.spawn("node-0", "node-0", main)
        clock.run()
    for node in nodes.values():
        node.close()
    assert {scale: node._asks_first for scale, node in nodes.items()} == {1.0: False, ASK_ABOVE_BYTES: True}


def test_background_work_runs_on_the_clock_and_stops_with_its_node() -> None:
    clock = VirtualClock()
    network = VirtualNetwork(clock)
    ticks: dict[str, list[float]] = {"node-0": [], "node-1": []}
    workers = []

    def start(name: str) -> None:
        peer = network.join(name)

        def tick() -> None:
            while True:
                ticks[name].append(clock.now)
                peer.compute(0.1)

        def main() -> None:
            worker = peer.start_background(f"ticker-{name}", tick)
            workers.append(worker)
            peer.compute(1.05)
            with pytest.raises(RuntimeError, match=r"after VirtualClock\.run"):
                worker.join()  # a simulated node cannot wait for it

        clock.spawn(name, name, main)

    start("node-0")
    start("node-1")
    clock.at(0.45, lambda: network.crash("node-0", after_round=0, detect_s=1.0))
    clock.run()
    assert ticks["node-0"] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])  # it stopped with its node
    assert ticks["node-1"] == pytest.approx([0.1 * k for k in range(11)])  # until the last main ended
    for worker in workers:
        worker.join()
    assert all(worker.glet.dead for worker in workers)


def simulated_rounds(*flags: str) -> list[dict[str, float]]:
    """``gossipmesh simulate --json`` on 16 nodes of an exponential graph, 40 rounds of 100 ms."""
    argv = ["simulate", "--nodes", "16", "--topology", "exponential", "--rounds", "40", "--json"]
    out = io.StringIO()
    config = parse_config([*argv, "--model-size", "1000000", *flags], env={})
    assert isinstance(config, SimulateConfig)
    assert simulate_command.run(config, out) == 0
    rounds: list[dict[str, float]] = json.loads(out.getvalue())["rounds"]
    return rounds


def test_simulate_splits_the_mesh_in_halves_until_the_partition_heals() -> None:
    whole = [p["consensus_distance"] for p in simulated_rounds("--round-timeout", "0.2")]
    split = simulated_rounds("--round-timeout", "0.2", "--partition", "0:1.5")
    distances = [p["consensus_distance"] for p in split]
    healed = next(p["round"] for p in split if p["virtual_time_s"] > 1.6)
    # while split each half averages on its own: the distance stops at the gap between the halves
    assert distances[healed - 1] > 0.5 * distances[2] > 1e3 * whole[healed - 1]
    assert distances[healed + 10] < 1e-3 * distances[healed - 1]  # and falls again once messages cross


def test_simulate_crashed_nodes_stop_counting_and_joiners_take_part(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rounds = simulated_rounds("--crash", "0.25@2", "--join", "2@3", "--join", "1@100")
    nodes = [int(p["nodes"]) for p in rounds]
    # 4 crashed nodes stop counting, never to return; both joiners start in the same round
    assert [count for count, _ in itertools.groupby(nodes)] == [16, 12, 14]
    first_of = {count: next(p for p in rounds if p["nodes"] == count) for count in (12, 14)}
    assert first_of[12]["virtual_time_s"] > 2 and first_of[14]["virtual_time_s"] > 3
    assert rounds[-1]["consensus_distance"] < 1e-4  # the joiners took part in the averaging
    assert "before --join at 100 s; raise --rounds" in capsys.readouterr().err


def test_simulate_link_sets_one_nodes_uplink_apart_from_the_bandwidth() -> None:
    """--link 0:8: node 0's uplink carries 1 MB/s, every other one --bandwidth's 10 Gbit/s; a
    mesh that waits for every neighbour goes at the pace node 0's uplink sends its models."""
    flags = ("--algorithm", "dpsgd:stragglers=wait", "--round-timeout", "100")
    even = simulated_rounds(*flags)[-1]
    slow = simulated_rounds(*flags, "--link", "0:8")[-1]
    assert slow["bytes_per_node"] == even["bytes_per_node"]
    assert even["virtual_time_s"] < 40 * 0.2
    assert slow["virtual_time_s"] == pytest.approx(slow["bytes_per_node"] / 1e6, rel=0.05)


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--link", "16:10"], "--link: '16:10': rank 16 is not in 0..15"),
        (["--link", "17:10", "--join", "1@1"], "--link: '17:10': rank 17 is not in 0..16"),
        (["--algorithm", "allreduce", "--link", "10"], "models one --bandwidth for every link"),
        (["--crash", "0.1"], "--crash: '0.1': expected FRACTION@SECONDS with seconds >= 0, e.g. 0.1@2"),
        (["--crash", "0.01@1"], "FRACTION must be in [0.0625, 1]"),
        (["--crash", "0.5@1", "--crash", "0.5@2"], "together they crash all 16 nodes"),
        (["--join", "2.5@1"], "--join: '2.5@1': '2.5' is not a whole number"),
        (["--partition", "3:1"], "need 0 <= START < END, e.g. 1:4"),
        (["--algorithm", "allreduce", "--partition", "1:2"], "time model without faults"),
    ],
)
def test_simulate_fault_flags_say_what_to_write(
    flags: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--nodes", "16", *flags]) == 2
    assert problem in capsys.readouterr().err
