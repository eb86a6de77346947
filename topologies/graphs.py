"""Static graph builders over networkx. Nodes are ``0..n-1``; every graph is simple and connected.

Each builder takes the node count and its own keyword parameters, and raises
:class:`TopologyError` saying why when the graph does not exist for that n (a hypercube needs a
power of two, a d-regular graph needs n*d even...). Random graphs are seeded, so every node of a
mesh builds the same one.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path

import networkx as nx

RANDOM_GRAPH_TRIES = 100


class TopologyError(ValueError):
    """A topology that cannot be built as asked; the message says why and what to use."""


def ring(n: int) -> nx.Graph:
    """Each node talks to its two neighbours on a cycle."""
    return nx.cycle_graph(n) if n > 2 else nx.complete_graph(n)


def torus(n: int, rows: int = 0) -> nx.Graph:
    """A 2-D grid with wrap-around; node r * cols + c sits at row r, column c."""
    rows, cols = torus_shape(n, rows)
    grid = nx.grid_2d_graph(rows, cols, periodic=True)
    return _simple(nx.convert_node_labels_to_integers(grid, ordering="sorted"))


def torus_shape(n: int, rows: int = 0) -> tuple[int, int]:
    """(rows, cols) of a torus on n nodes; rows defaults to the divisor of n nearest sqrt(n)."""
    rows = rows or max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    if rows < 1 or n % rows:
        raise TopologyError(f"torus: {rows} rows do not divide {n} nodes; pick rows that divide n")
    return rows, n // rows


def exponential(n: int) -> nx.Graph:
    """Node i talks to i +- 2^k (mod n) for every 2^k < n: degree ~ 2 log2 n, fast mixing."""
    graph = nx.empty_graph(n)
    for hop in _powers_of_two_below(n):
        graph.add_edges_from((i, (i + hop) % n) for i in range(n) if (i + hop) % n != i)
    return graph


def directed_exponential(n: int) -> nx.DiGraph:
    """Node i sends to i + 2^k (mod n) only: half the messages of ``exponential``."""
    graph = nx.DiGraph()
    graph.add_nodes_from(range(n))
    for hop in _powers_of_two_below(n):
        graph.add_edges_from((i, (i + hop) % n) for i in range(n) if (i + hop) % n != i)
    return graph


def hypercube(n: int) -> nx.Graph:
    """Nodes are bit strings; neighbours differ in one bit. Needs n a power of two."""
    if n & (n - 1):
        lower = 1 << (n.bit_length() - 1)
        raise TopologyError(
            f"hypercube needs a power-of-two number of nodes, got {n}; use {lower} or {lower * 2} "
            "nodes, or the exponential topology"
        )
    if n == 1:
        return nx.empty_graph(1)
    return nx.convert_node_labels_to_integers(nx.hypercube_graph(n.bit_length() - 1), ordering="sorted")


def complete(n: int) -> nx.Graph:
    """Everyone talks to everyone: exact average in one round, n - 1 messages per node."""
    return nx.complete_graph(n)


def star(n: int) -> nx.Graph:
    """Node 0 talks to everyone else; the others only to node 0."""
    return nx.star_graph(n - 1) if n > 1 else nx.empty_graph(1)


def random_regular(n: int, degree: int = 3, seed: int = 0) -> nx.Graph:
    """A uniformly random connected ``degree``-regular graph (seeded)."""
    _check_regular(n, degree, "random-regular")
    return _first_connected(lambda s: nx.random_regular_graph(degree, n, seed=s), seed, "random-regular")


def erdos_renyi(n: int, p: float = 0.0, seed: int = 0) -> nx.Graph:
    """G(n, p), seeded; p defaults to 2 ln(n) / n. A disconnected draw is redrawn, and after
    ``RANDOM_GRAPH_TRIES`` draws the last one is repaired by joining its components."""
    p = p or min(1.0, 2 * math.log(max(n, 2)) / n)
    if not 0 < p <= 1:
        raise TopologyError(f"erdos-renyi: p must be in (0, 1], got {p}")
    graph = nx.empty_graph(n)
    for attempt in range(RANDOM_GRAPH_TRIES):
        graph = nx.gnp_random_graph(n, p, seed=seed * RANDOM_GRAPH_TRIES + attempt)
        if nx.is_connected(graph):
            return graph
    components = [min(c) for c in nx.connected_components(graph)]
    graph.add_edges_from(itertools.pairwise(components))
    return graph


def small_world(n: int, k: int = 4, p: float = 0.1, seed: int = 0) -> nx.Graph:
    """Watts-Strogatz: a ring lattice with k nearest neighbours, each edge rewired with prob. p."""
    if not 2 <= k < n:
        raise TopologyError(f"small-world: k must be in 2..n-1 (n = {n}), got {k}")
    if not 0 <= p <= 1:
        raise TopologyError(f"small-world: p must be in [0, 1], got {p}")
    try:
        graph = nx.connected_watts_strogatz_graph(n, k, p, tries=RANDOM_GRAPH_TRIES, seed=seed)
    except nx.NetworkXError as exc:
        raise TopologyError(f"small-world: {exc}; use a smaller p") from None
    return _simple(graph)


def expander(n: int, degree: int = 4, seed: int = 0) -> nx.Graph:
    """A random regular near-Ramanujan expander (second eigenvalue <= 2 sqrt(d-1) + 0.1).

    ``degree`` must be even; for fewer than degree + 1 nodes it is lowered to the largest even
    degree that fits (a complete graph for n <= 3).
    """
    if degree < 2 or degree % 2:
        raise TopologyError(f"expander: degree must be an even number >= 2, got {degree}")
    if n <= 3:
        return nx.complete_graph(n)
    degree = min(degree, n - 1 - (n - 1) % 2)
    try:
        graph = nx.random_regular_expander_graph(
            n, degree, epsilon=0.1, max_tries=RANDOM_GRAPH_TRIES, seed=seed
        )
    except nx.NetworkXError as exc:
        raise TopologyError(f"expander on {n} nodes with degree {degree}: {exc}") from None
    return _simple(graph)


def from_file(n: int, path: str) -> nx.Graph:
    """An undirected graph from a file: an edge list (``u v`` per line, ``#`` comments) or JSON
    adjacency (``[[1, 2], [0], [0]]`` or ``{"0": [1, 2], ...}``), nodes numbered 0..n-1."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise TopologyError(f"cannot read topology file {path}: {exc.strerror}") from None
    graph = nx.Graph()
    try:
        if file.suffix == ".json":
            adjacency = json.loads(text)
            items = adjacency.items() if isinstance(adjacency, dict) else enumerate(adjacency)
            for node, neighbours in items:
                graph.add_node(int(node))
                graph.add_edges_from((int(node), int(other)) for other in neighbours)
        else:
            for number, line in enumerate(text.splitlines(), 1):
                fields = line.split("#")[0].split()
                if fields and len(fields) != 2:
                    raise ValueError(f"line {number}: expected 'u v', got {line!r}")
                if fields:
                    graph.add_edge(int(fields[0]), int(fields[1]))
    except (ValueError, TypeError, AttributeError) as exc:
        raise TopologyError(f"topology file {path}: {exc}") from None
    if set(graph.nodes) != set(range(n)):
        raise TopologyError(
            f"topology file {path} has nodes {sorted(graph.nodes)[:8]}...; a mesh of {n} needs "
            f"exactly 0..{n - 1}"
        )
    return _simple(graph)


def pair_with_listeners(graph: nx.Graph, no_listen: frozenset[int]) -> nx.Graph:
    """``graph`` with no edge between two ``no_listen`` vertices (members that accept no
    connection cannot reach each other): each such edge u-v (or u->v) becomes u-l(v) and
    l(u)-v, where l(x) is the listening vertex x mod (their count) picks, so degrees stay and
    every vertex keeps a neighbour. A graph that was connected stays so: components left apart
    are joined through their least listening vertices. With no listening vertex, the others
    are left alone."""
    listening = sorted(set(graph) - no_listen)
    rewired = graph.copy()
    for u, v in [(u, v) for u, v in graph.edges if u in no_listen and v in no_listen]:
        rewired.remove_edge(u, v)
        if listening:
            rewired.add_edge(u, listening[v % len(listening)])
            rewired.add_edge(listening[u % len(listening)], v)
    connected = nx.is_weakly_connected if graph.is_directed() else nx.is_connected
    if listening and connected(graph) and not connected(rewired):
        parts = nx.weakly_connected_components if graph.is_directed() else nx.connected_components
        anchors = sorted(min(set(part) - no_listen) for part in parts(rewired))
        for u, v in itertools.pairwise(anchors):
            rewired.add_edge(u, v)
            rewired.add_edge(v, u)  # (the same edge when undirected)
    return rewired


def _simple(graph: nx.Graph) -> nx.Graph:
    """Drop self-loops and parallel edges (grids and rewiring can create them)."""
    simple = nx.DiGraph(graph) if graph.is_directed() else nx.Graph(graph)
    simple.remove_edges_from(list(nx.selfloop_edges(simple)))
    if simple.number_of_nodes() > 1 and not nx.is_connected(simple):
        raise TopologyError("the graph is not connected: averaging could never reach consensus")
    return simple


def _first_connected(draw: Callable[[int], nx.Graph], seed: int, name: str) -> nx.Graph:
    for attempt in range(RANDOM_GRAPH_TRIES):
        graph = draw(seed * RANDOM_GRAPH_TRIES + attempt)
        if nx.is_connected(graph):
            return graph
    raise TopologyError(f"{name}: no connected graph in {RANDOM_GRAPH_TRIES} draws; raise the degree")


def _check_regular(n: int, degree: int, name: str) -> None:
    if not 1 <= degree < n:
        raise TopologyError(f"{name}: degree must be in 1..n-1 (n = {n}), got {degree}")
    if n * degree % 2:
        raise TopologyError(
            f"{name}: a {degree}-regular graph on {n} nodes does not exist (n * degree is odd); "
            f"use degree {degree + 1} or an even node count"
        )


def _powers_of_two_below(n: int) -> list[int]:
    return [1 << k for k in range(max(n - 1, 0).bit_length())]
