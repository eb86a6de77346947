"""Mixing weights: how node i averages itself with what it receives.

A scheme gives one node's row (its own weight and one weight per node it receives from) using
only the degrees around that node, so every node can compute its row alone; the full matrix W
(row i = node i's row) is the same rows stacked, for analysis and checks.

Undirected schemes give a symmetric doubly-stochastic W. ``push-sum`` is for directed graphs:
each node splits its value equally among itself and its out-neighbours, so W is column
stochastic; on the regular directed graphs built here it is doubly stochastic as well.
"""

from __future__ import annotations

from collections.abc import Callable

import networkx as nx
import numpy as np

from topologies.graphs import TopologyError

Row = tuple[float, dict[int, float]]
_TOLERANCE = 1e-9


def metropolis_hastings(graph: nx.Graph, i: int) -> Row:
    """W_ij = 1 / (1 + max(deg i, deg j)) on edges; symmetric on any graph."""
    degree = graph.degree
    row = {j: 1.0 / (1 + max(degree[i], degree[j])) for j in graph.neighbors(i)}
    return 1.0 - sum(row.values()), row


def max_degree(graph: nx.Graph, i: int) -> Row:
    """W_ij = 1 / (1 + max degree of the graph) on edges."""
    weight = 1.0 / (1 + max(d for _, d in graph.degree))
    row = dict.fromkeys(graph.neighbors(i), weight)
    return 1.0 - sum(row.values()), row


def uniform(graph: nx.Graph, i: int) -> Row:
    """W_ij = 1 / (1 + d) for a d-regular graph: every node weighs itself like a neighbour."""
    degrees = {d for _, d in graph.degree}
    if len(degrees) > 1:
        raise TopologyError(f"uniform weights need a regular graph; degrees here are {sorted(degrees)}")
    weight = 1.0 / (1 + degrees.pop())
    return weight, dict.fromkeys(graph.neighbors(i), weight)


def push_sum(graph: nx.DiGraph, i: int) -> Row:
    """Node j sends 1 / (1 + out-degree j) of its value to each out-neighbour and keeps as much."""
    row = {j: 1.0 / (1 + graph.out_degree(j)) for j in graph.predecessors(i)}
    return 1.0 / (1 + graph.out_degree(i)), row


SCHEMES: dict[str, Callable[[nx.Graph, int], Row]] = {
    "metropolis-hastings": metropolis_hastings,
    "max-degree": max_degree,
    "uniform": uniform,
}


def matrix(graph: nx.Graph, scheme: Callable[[nx.Graph, int], Row]) -> np.ndarray:
    """The mixing matrix: node i's row from ``scheme``, for every node."""
    n = graph.number_of_nodes()
    weights = np.zeros((n, n))
    for i in range(n):
        weights[i, i], row = scheme(graph, i)
        for j, w in row.items():
            weights[i, j] = w
    return weights


def check_doubly_stochastic(weights: np.ndarray, *, symmetric: bool = True) -> None:
    """Raise unless ``weights`` is non-negative and doubly stochastic (and symmetric if asked)."""
    check_column_stochastic(weights)
    if not np.allclose(weights.sum(axis=1), 1.0, atol=_TOLERANCE):
        raise ValueError("mixing weight rows must sum to 1")
    if symmetric and not np.allclose(weights, weights.T, atol=_TOLERANCE):
        raise ValueError("mixing weights must be symmetric")


def check_column_stochastic(weights: np.ndarray) -> None:
    """Raise unless ``weights`` is non-negative with columns summing to 1 (push-sum)."""
    if (weights < -_TOLERANCE).any():
        raise ValueError("mixing weights must be non-negative")
    if not np.allclose(weights.sum(axis=0), 1.0, atol=_TOLERANCE):
        raise ValueError("mixing weight columns must sum to 1")
