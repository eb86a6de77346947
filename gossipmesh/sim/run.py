"""Run a simulated mesh: every node is the real averager on a virtual peer, in a greenlet.

A node's main loop is the daemon's in miniature: a local step (``compute`` of virtual time, then
the workload's step, which runs the algorithm's ``after_step``), recorded after each one. Faults
(crashes, joins) are clock events. A node that has taken its last round leaves, as a daemon
whose steps ran out does. The figures per round are those of the mesh report:
the consensus distance of the nodes' models after that round, when the last node finished it
(virtual seconds), the bytes each node had sent by then on average, and how many nodes did.
"""

from __future__ import annotations

import bisect
import functools
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from gossip import Algorithm, Averager, Codec, consensus_distance
from gossipmesh.sim.clock import VirtualClock
from gossipmesh.sim.links import VirtualNetwork, VirtualPeer
from gossipmesh.sim.scenario import Scenario, node_id
from topologies import Topology, member_order

VECTOR_SIZE = 32  # elements of a pure-averaging node's vector (float64)
START_MEAN = 1.0  # start vectors are N(START_MEAN, 1): a non-zero mean keeps the distance defined
JOIN_AHEAD_ROUNDS = 2  # a joiner starts this many rounds after the furthest live node
EIGEN_TOLERANCE = 1e-9  # eigenvalues this close are one (the slowest mode's eigenspace)


@dataclass(frozen=True)
class RoundPoint:
    round: int
    consensus_distance: float
    virtual_time_s: float
    bytes_per_node: float
    nodes: int  # how many nodes finished this round (crashed ones stop counting, joiners start)
    accuracy: float | None = None  # mean held-out accuracy of the nodes (training workloads)

    def as_json(self) -> dict[str, float]:
        return {k: round(v, 9) for k, v in asdict(self).items() if v is not None}


@dataclass
class SimNode:
    """One node's state: its parameters, its averager, and its local step, which says whether
    it ended with a gossip round (a simulated round is the local steps up to one)."""

    params: np.ndarray
    averager: Averager
    step: Callable[[], bool]
    accuracy: Callable[[], float] | None = None


NodeFactory = Callable[[VirtualPeer, int, "np.ndarray | None"], SimNode]
"""Builds node ``index`` on its peer, starting from a given model (a joiner's copy) or its own."""


@dataclass(frozen=True)
class SimResult:
    rounds: list[RoundPoint]
    sim_seconds: float  # real time the simulation took
    final: dict[str, np.ndarray]  # each node's parameters at the end
    messages_lost: int
    step_ends: dict[str, list[float]]  # when each node finished each of its steps (virtual s)

    def steps_per_s(self) -> float:
        """The mesh's steady throughput in local steps per virtual second: steps done by all
        nodes until the first one finished its last (a fast node of an asynchronous algorithm
        does more steps than a straggler in the same time)."""
        until = min(ends[-1] for ends in self.step_ends.values() if ends)
        return sum(bisect.bisect_right(ends, until) for ends in self.step_ends.values()) / until

    def as_json(self) -> dict[str, object]:
        return {"rounds": [p.as_json() for p in self.rounds], "sim_seconds": round(self.sim_seconds, 3)}


def start_vectors(nodes: int, seed: int, size: int = VECTOR_SIZE) -> np.ndarray:
    """Pure averaging's start: one random vector per node, with a non-zero mean."""
    return np.random.default_rng(seed).standard_normal((nodes, size)) + START_MEAN


def slowest_mode_vectors(weights: np.ndarray, seed: int, size: int = VECTOR_SIZE) -> np.ndarray:
    """Start vectors whose disagreement lies in the slowest eigenspace of a symmetric mixing
    matrix: it contracts by exactly |lambda_2| from the first round on, which a random start only
    approaches once its faster modes have died out (~n^2 rounds on a ring, ~50 rounds on an
    exponential graph of 1,024 nodes)."""
    if not np.allclose(weights, weights.T):
        raise ValueError("slowest_mode_vectors needs the symmetric weights of an undirected graph")
    n = len(weights)
    values, modes = np.linalg.eigh(weights - np.full((n, n), 1.0 / n))
    slowest = values[np.argmax(np.abs(values))]
    space = modes[:, np.abs(values - slowest) < EIGEN_TOLERANCE]  # a cosine and a sine on a ring
    mix = np.random.default_rng(seed).standard_normal((space.shape[1], size))
    return START_MEAN + math.sqrt(n) * space @ mix


def averaging(
    vectors: np.ndarray, algorithm: Algorithm, topology: Topology, round_timeout: float, codec: Codec
) -> NodeFactory:
    """Pure averaging (no training): node i starts from ``vectors[i]``; a step is one
    ``after_step`` of the algorithm."""

    def build(peer: VirtualPeer, index: int, start: np.ndarray | None) -> SimNode:
        params = (vectors[index] if start is None else start).copy()
        averager = algorithm.build(
            peer, params, topology=topology, round_timeout=round_timeout, lock=None, codec=codec
        )

        def step() -> bool:
            averager.after_step()
            return True

        return SimNode(params, averager, step)

    return build


def simulate(
    scenario: Scenario,
    build: NodeFactory,
    model_nbytes: int,
    on_round: Callable[[int], None] = lambda _: None,
) -> SimResult:
    """Run ``scenario`` with nodes made by ``build``; ``model_nbytes`` is the size of one node's
    parameters in memory (the wire size is ``scenario.model_bytes`` when given). ``on_round(r)``
    is called each time a node has taken its round ``r`` (counting from 1), for progress."""
    started = time.perf_counter()
    clock = VirtualClock()
    network = VirtualNetwork(
        clock,
        link=scenario.link,
        links=scenario.links,
        loss=scenario.loss,
        partitions=scenario.partitions,
        byte_scale=(scenario.model_bytes or model_nbytes) / model_nbytes,
        seed=scenario.seed,
    )
    step_times = scenario.compute.step_times(
        scenario.nodes + len(scenario.joins), scenario.rounds, scenario.seed
    )
    nodes: dict[str, SimNode] = {}
    history: defaultdict[int, list[tuple[np.ndarray, int, float, float | None]]] = defaultdict(list)
    step_ends: dict[str, list[float]] = {}

    def launch(index: int, first_round: int, start: np.ndarray | None) -> None:
        name = node_id(index)
        peer = network.join(name, first_round)
        ends: list[float] = []
        step_ends[name] = ends

        def main() -> None:
            node = nodes[name] = build(peer, index, start)
            if first_round:
                node.averager.restart(first_round)
            for r in range(first_round, scenario.rounds):
                peer.compute(step_times[index, r])
                while not node.step():
                    peer.compute(step_times[index, r])
                accuracy = node.accuracy() if node.accuracy else None
                history[r].append((node.params.copy(), peer.bytes_sent, clock.now, accuracy))
                ends.append(clock.now)
                on_round(r + 1)
            # as a daemon whose steps ran out: the others stop waiting for it after its last round
            network.leave(name, node.averager.round - 1)

        clock.spawn(name, name, main)

    def crash(index: int) -> None:
        name = node_id(index)
        last_round = nodes[name].averager.round - 1 if name in nodes else -1
        network.crash(name, last_round, scenario.detect_s)

    def join(index: int) -> None:
        live = [n for n in member_order(network.roster.members()) if network.peers[n].alive and n in nodes]
        if not live:
            return
        # the furthest node that has taken a step: one that joined a moment ago waits at its
        # first round, and counting it would start each of a batch of joiners further ahead
        furthest = max((nodes[n].averager.round for n in live if step_ends[n]), default=0)
        first_round = furthest + JOIN_AHEAD_ROUNDS
        launch(index, first_round, nodes[live[0]].params.copy())

    for index in range(scenario.nodes):
        launch(index, 0, None)
    for c in scenario.crashes:
        clock.at(c.at_s, functools.partial(crash, c.node))
    for k, at_s in enumerate(scenario.joins):
        clock.at(at_s, functools.partial(join, scenario.nodes + k))
    try:
        clock.run()
    finally:
        clock.close()
        for node in nodes.values():
            node.averager.close()
    points = [_point(r, history[r]) for r in sorted(history)]
    final = {name: node.params.copy() for name, node in nodes.items()}
    lost = sum(peer.messages_lost for peer in network.peers.values())
    return SimResult(points, time.perf_counter() - started, final, lost, step_ends)


def _point(r: int, records: list[tuple[np.ndarray, int, float, float | None]]) -> RoundPoint:
    accuracies = [a for _, _, _, a in records if a is not None]
    return RoundPoint(
        round=r,
        consensus_distance=consensus_distance([params for params, _, _, _ in records]),
        virtual_time_s=float(max(t for _, _, t, _ in records)),
        bytes_per_node=float(np.mean([b for _, b, _, _ in records])),
        nodes=len(records),
        accuracy=float(np.mean(accuracies)) if accuracies else None,
    )
