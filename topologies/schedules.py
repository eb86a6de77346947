"""Time-varying topologies: a different (sparse) graph every round, the same on every node.

A schedule is a function of (n, round, params) only, so nodes that agree on the member list
agree on each round's graph without talking about it.
"""

from __future__ import annotations

import math
from functools import lru_cache

import networkx as nx
import numpy as np


def one_peer_exponential(n: int, round: int) -> nx.DiGraph:
    """Round r: node i sends to i + 2^(r mod tau), tau = ceil(log2 n) (Ying et al. 2021).

    One message per node per round; for n a power of two, tau rounds of averaging give the
    exact average.
    """
    graph = nx.DiGraph()
    graph.add_nodes_from(range(n))
    period = one_peer_period(n)
    if period:
        hop = 1 << (round % period)
        graph.add_edges_from((i, (i + hop) % n) for i in range(n))
    return graph


def one_peer_period(n: int) -> int:
    return max(n - 1, 0).bit_length()


def random_matching(n: int, round: int, seed: int = 0) -> nx.Graph:
    """A random perfect matching each round (one node idles when n is odd), seeded by
    (seed, round, n) so every node draws the same one."""
    order = np.random.default_rng([seed, round, n]).permutation(n)
    graph = nx.empty_graph(n)
    graph.add_edges_from(zip(order[0::2].tolist(), order[1::2].tolist(), strict=False))
    return graph


def random_matching_contraction(n: int) -> float:
    """Expected per-round contraction of random matching: sqrt of the top eigenvalue of
    E[(W - J)^T (W - J)] on the disagreement space.

    W = (I + P) / 2 with P a random matching's permutation, so W^2 = W and the expectation is
    E[W] - J: (n - 2) / (2 (n - 1)) for even n, 1/2 for odd n (one node idles each round).
    """
    if n < 2:
        return 0.0
    return math.sqrt((n - 2) / (2 * (n - 1)) if n % 2 == 0 else 0.5)


@lru_cache(maxsize=64)  # keyed by the (frozen, cached) graph object: asked on every exchange
def active_passive(graph: nx.Graph) -> tuple[frozenset[int], frozenset[int]]:
    """Split nodes into active and passive sides for asynchronous pairwise gossip (AD-PSGD).

    Actives only start exchanges and passives only answer, so two nodes never wait on each
    other: the graph's 2-colouring when it is bipartite, else even and odd node numbers (edges
    inside a side are then not used for exchanges).
    """
    if nx.is_bipartite(graph) and graph.number_of_nodes() > 1:
        coloring = nx.bipartite.color(graph)
        active = frozenset(v for v, c in coloring.items() if c == coloring[0])
    else:
        active = frozenset(v for v in graph if v % 2 == 0)
    return active, frozenset(graph) - active


def pairwise_partner(graph: nx.Graph, node: int, round: int, seed: int = 0) -> int | None:
    """The passive neighbour an active ``node`` exchanges with in ``round`` (seeded), or None
    when the node is passive or has no passive neighbour."""
    active, passive = active_passive(graph)
    choices = sorted(set(graph.neighbors(node)) & passive) if node in active else []
    if not choices:
        return None
    partner: int = choices[int(np.random.default_rng([seed, round, node]).integers(len(choices)))]
    return partner
