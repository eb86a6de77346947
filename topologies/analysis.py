"""What a topology costs and buys: degree, bytes per round, diameter, spectral gap, contraction.

``contraction`` is the factor by which the distance to consensus shrinks per round of pure
averaging, asymptotically: the second largest eigenvalue modulus of W for a static graph
(so ``spectral_gap = 1 - contraction``); for a periodic schedule, the same for the product of
one period, per round; for a random schedule, the root of the top eigenvalue of
E[(W - J)^T (W - J)] (the expected contraction of the squared distance), in closed form.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import networkx as nx
import numpy as np

from topologies.topology import RANDOM_SCHEDULE_SAMPLES, Topology


@dataclass(frozen=True)
class Analysis:
    name: str
    nodes: int
    edges: int  # per round; arcs for a directed graph
    degree_max: int  # messages a node sends per round, at most
    degree_mean: float
    diameter: int  # hops; of the union of one period (or the sampled rounds) when time-varying
    spectral_gap: float
    contraction: float
    period: int | None
    bytes_per_round: int  # per node, at most: degree_max x model bytes

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def analyze(topology: Topology, n: int, model_bytes: int = 0) -> Analysis:
    period = topology.period(n)
    rounds = range(period if period is not None else RANDOM_SCHEDULE_SAMPLES)
    first = topology.graph(n, 0)
    out_degrees = [d for _, d in (first.out_degree if first.is_directed() else first.degree)]
    contraction = _contraction(topology, n, rounds)
    return Analysis(
        name=str(topology),
        nodes=n,
        edges=first.number_of_edges(),
        degree_max=max(out_degrees),
        degree_mean=round(float(np.mean(out_degrees)), 3),
        diameter=_diameter([topology.graph(n, r) for r in rounds]),
        spectral_gap=round(1.0 - contraction, 6),
        contraction=round(contraction, 6),
        period=period,
        bytes_per_round=max(out_degrees) * model_bytes,
    )


def second_eigenvalue_modulus(weights: np.ndarray) -> float:
    """|lambda_2|: the largest eigenvalue modulus of W once the consensus direction is removed."""
    n = len(weights)
    return _spectral_radius(weights - np.full((n, n), 1.0 / n))


def _contraction(topology: Topology, n: int, rounds: range) -> float:
    if topology.family.expected_contraction is not None:
        return topology.family.expected_contraction(n)
    if n == 1:
        return 0.0
    average = np.full((n, n), 1.0 / n)
    product = np.eye(n)
    for r in rounds:
        product = topology.weights(n, r) @ product
    return float(_spectral_radius(product - average) ** (1.0 / len(rounds)))


def _spectral_radius(matrix: np.ndarray) -> float:
    if np.allclose(matrix, matrix.T):
        return float(np.abs(np.linalg.eigvalsh(matrix)).max())
    return float(np.abs(np.linalg.eigvals(matrix)).max())


def _diameter(graphs: list[nx.Graph]) -> int:
    """Hops along message directions in the union of ``graphs``; -1 when not all are reachable."""
    union = nx.compose_all(graphs)
    connected = nx.is_strongly_connected(union) if union.is_directed() else nx.is_connected(union)
    return int(nx.diameter(union)) if connected else -1
