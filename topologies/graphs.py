"""Named graph builders. Nodes are ``0..n-1``; every builder returns a simple, connected graph."""

from __future__ import annotations

from collections.abc import Callable

import networkx as nx


class TopologyError(ValueError):
    """A topology that cannot be built as asked; the message says why and what to use."""


def ring(n: int) -> nx.Graph:
    """Each node talks to its two neighbours on a cycle (one for n = 2)."""
    return nx.cycle_graph(n) if n > 2 else nx.complete_graph(n)


def exponential(n: int) -> nx.Graph:
    """Node i talks to i +- 2^k (mod n) for every 2^k < n: degree ~ 2 log2 n, fast mixing."""
    graph = nx.empty_graph(n)
    hop = 1
    while hop < n:
        graph.add_edges_from((i, (i + hop) % n) for i in range(n) if (i + hop) % n != i)
        hop *= 2
    return graph


def complete(n: int) -> nx.Graph:
    """Everyone talks to everyone: exact average in one round, n - 1 messages per node."""
    return nx.complete_graph(n)


BUILDERS: dict[str, Callable[[int], nx.Graph]] = {
    "ring": ring,
    "exponential": exponential,
    "complete": complete,
}


def build(name: str, n: int) -> nx.Graph:
    """The graph called ``name`` on ``n`` nodes."""
    if name not in BUILDERS:
        raise TopologyError(f"unknown topology {name!r}; choose one of {', '.join(BUILDERS)}")
    if n < 1:
        raise TopologyError(f"a topology needs at least one node, got {n}")
    return BUILDERS[name](n)
