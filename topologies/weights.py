"""Mixing weights: the matrix W whose row i says how node i averages itself with its neighbours."""

from __future__ import annotations

import networkx as nx
import numpy as np

_TOLERANCE = 1e-12


def metropolis_hastings(graph: nx.Graph) -> np.ndarray:
    """W_ij = 1 / (1 + max(deg i, deg j)) on edges, W_ii = 1 - sum of the row.

    Symmetric and doubly stochastic on any undirected graph, using only the degrees of a node
    and its neighbours, so every node can compute its own row.
    """
    n = graph.number_of_nodes()
    weights = np.zeros((n, n))
    degree = dict(graph.degree())
    for i, j in graph.edges():
        weights[i, j] = weights[j, i] = 1.0 / (1 + max(degree[i], degree[j]))
    weights[np.diag_indices(n)] = 1.0 - weights.sum(axis=1)
    check_doubly_stochastic(weights)
    return weights


def check_doubly_stochastic(weights: np.ndarray) -> None:
    """Raise unless ``weights`` is symmetric, non-negative and doubly stochastic."""
    if (weights < -_TOLERANCE).any():
        raise ValueError("mixing weights must be non-negative")
    if not np.allclose(weights, weights.T, atol=_TOLERANCE):
        raise ValueError("mixing weights must be symmetric")
    if not np.allclose(weights.sum(axis=1), 1.0, atol=1e-9):
        raise ValueError("mixing weight rows must sum to 1")
