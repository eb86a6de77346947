"""Pure averaging converges at the rate the topology's spectrum predicts.

32 nodes run the real D-PSGD code over the in-memory network (one thread per node); the measured
contraction of the consensus distance per round, once the slowest mode dominates, must be
within 10% of ``analyze(...).contraction``.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import average_in_threads

from gossip import consensus_distance
from gossipmesh.sim.memory import MemoryNetwork
from topologies import FAMILIES, Topology, analyze

N = 32
MAX_ROUNDS = 400
FLOOR = 1e-10  # relative distance below which float64 noise takes over


def measured_distances(name: str, rounds: int) -> list[float]:
    network = MemoryNetwork()
    peers = [network.join(f"node-{i}") for i in range(N)]
    rng = np.random.default_rng(5)
    vectors = [rng.standard_normal(64) + 2.0 for _ in range(N)]
    history: list[list[np.ndarray]] = [[] for _ in range(N)]
    start = consensus_distance(vectors)
    average_in_threads(peers, vectors, topology=name, rounds=rounds, timeout=30, history=history)
    return [start] + [consensus_distance([h[r] for h in history]) for r in range(rounds)]


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "file"])
def test_measured_contraction_matches_the_spectral_prediction(name: str) -> None:
    predicted = analyze(Topology.parse(name), N).contraction
    if predicted < 1e-6:  # complete graph, one-peer exponential: exact average after one period
        period = Topology.parse(name).period(N) or 1
        distances = measured_distances(name, period)
        assert distances[period] < 1e-12 * distances[0]
        return
    rounds = min(MAX_ROUNDS, int(np.log(FLOOR) / np.log(predicted)))
    distances = measured_distances(name, rounds)
    last = max(r for r, d in enumerate(distances) if d > FLOOR * distances[0])
    first = last // 2  # skip the transient: faster modes die out first
    measured = (distances[last] / distances[first]) ** (1 / (last - first))
    assert measured == pytest.approx(predicted, rel=0.10), (measured, predicted, first, last)
