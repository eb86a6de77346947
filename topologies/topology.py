"""Topologies by name: ``NAME`` or ``NAME:key=value,...`` (``file:PATH`` for a user graph).

The same spelling works in ``--topology``, the config file and ``gossipmesh topology``
(``topologies.spec`` reads it). A :class:`Topology` builds its graph for any node count and
round, and gives each node its row of the mixing matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import networkx as nx
import numpy as np

from topologies import graphs, schedules
from topologies.graphs import TopologyError
from topologies.spec import Params, Spec, choice, number, spellings
from topologies.weights import SCHEMES, Row, matrix, push_sum

RANDOM_SCHEDULE_SAMPLES = 64  # rounds whose union gives a random schedule's diameter


@dataclass(frozen=True)
class Family:
    """One named topology: its builder and the parameters it accepts (name -> parser)."""

    build: Callable[..., nx.Graph]
    summary: str
    params: Mapping[str, Callable[[str], Any]] = field(default_factory=dict)
    directed: bool = False
    time_varying: bool = False  # built per round: build(n, round, **params)
    period: Callable[[int], int] | None = None  # rounds until a time-varying schedule repeats
    expected_contraction: Callable[[int], float] | None = None  # set for random schedules

    def accepted(self) -> Params:
        """``file:PATH`` takes the whole rest as its path; an undirected graph built from
        parameters also takes a weight scheme."""
        if "path" in self.params:
            return Params(self.params, positional="path", required=("path",))
        return Params({**self.params, **({} if self.directed else {"weights": choice(SCHEMES)})})


_SEEDED = {"seed": number(int)}
_DEGREE = {"degree": number(int, at_least=1)}
_PROBABILITY = number(float, at_least=0, at_most=1)
FAMILIES: dict[str, Family] = {
    "ring": Family(graphs.ring, "cycle; degree 2"),
    "torus": Family(graphs.torus, "2-D periodic grid; degree 4", {"rows": number(int, at_least=1)}),
    "exponential": Family(graphs.exponential, "i <-> i +- 2^k; degree ~2 log2 n"),
    "directed-exponential": Family(
        graphs.directed_exponential, "i -> i + 2^k; out-degree ~log2 n", directed=True
    ),
    "one-peer-exponential": Family(
        schedules.one_peer_exponential,
        "round r: i -> i + 2^(r mod log2 n); one peer per round",
        directed=True,
        time_varying=True,
        period=schedules.one_peer_period,
    ),
    "hypercube": Family(graphs.hypercube, "bit-flip neighbours; n a power of two"),
    "complete": Family(graphs.complete, "everyone; exact average in one round"),
    "star": Family(graphs.star, "node 0 is the hub"),
    "random-regular": Family(graphs.random_regular, "random d-regular", {**_DEGREE, **_SEEDED}),
    "erdos-renyi": Family(graphs.erdos_renyi, "G(n, p), connected", {"p": _PROBABILITY, **_SEEDED}),
    "small-world": Family(
        graphs.small_world, "Watts-Strogatz", {"k": number(int, at_least=1), "p": _PROBABILITY, **_SEEDED}
    ),
    "expander": Family(graphs.expander, "random near-Ramanujan d-regular", {**_DEGREE, **_SEEDED}),
    "random-matching": Family(
        schedules.random_matching,
        "a random perfect matching per round; one peer per round",
        dict(_SEEDED),
        time_varying=True,
        expected_contraction=schedules.random_matching_contraction,
    ),
    "file": Family(graphs.from_file, "file:PATH, an edge list or JSON adjacency", {"path": str}),
}


_CHOICES = {name: family.accepted() for name, family in FAMILIES.items()}
NAMES = tuple(spellings(_CHOICES))


@dataclass(frozen=True)
class Topology(Spec, what="topology", choices=_CHOICES):
    """A named topology with its parameters, e.g. ``Topology.parse("random-regular:degree=4")``."""

    @property
    def family(self) -> Family:
        return FAMILIES[self.name]

    def period(self, n: int) -> int | None:
        """Rounds after which the schedule repeats: 1 for a static graph, None for a random one."""
        if self.family.expected_contraction:
            return None
        return max(1, self.family.period(n)) if self.family.period else 1

    def graph(self, n: int, round: int = 0, no_listen: frozenset[int] = frozenset()) -> nx.Graph:
        """The graph of ``round`` on ``n`` nodes (the same for every round when static); with
        ``no_listen`` (nodes that accept no connection), none of those two is an edge (see
        :func:`~topologies.graphs.pair_with_listeners`)."""
        period = self.period(n)
        return _graph(self, n, round % period if period else round, no_listen)

    def row(self, n: int, i: int, round: int = 0, no_listen: frozenset[int] = frozenset()) -> Row:
        """Node i's mixing row in ``round``: (own weight, {sender: weight})."""
        graph = self.graph(n, round, no_listen)
        return push_sum(graph, i) if self.family.directed else self._scheme(graph, i)

    def weights(self, n: int, round: int = 0, no_listen: frozenset[int] = frozenset()) -> np.ndarray:
        """The full mixing matrix W of ``round`` (row i is node i's row)."""
        return matrix(self.graph(n, round, no_listen), push_sum if self.family.directed else self._scheme)

    def sends_to(self, n: int, i: int, round: int = 0, no_listen: frozenset[int] = frozenset()) -> list[int]:
        graph = self.graph(n, round, no_listen)
        return sorted(graph.successors(i) if self.family.directed else graph.neighbors(i))

    def _scheme(self, graph: nx.Graph, i: int) -> Row:
        return SCHEMES[self.options.get("weights", "metropolis-hastings")](graph, i)


@lru_cache(maxsize=256)
def _graph(topology: Topology, n: int, round: int, no_listen: frozenset[int]) -> nx.Graph:
    if n < 1:
        raise TopologyError(f"a topology needs at least one node, got {n}")
    if no_listen:
        return nx.freeze(graphs.pair_with_listeners(_graph(topology, n, round, frozenset()), no_listen))
    params = {k: v for k, v in topology.params if k != "weights"}
    family = topology.family
    graph = family.build(n, round, **params) if family.time_varying else family.build(n, **params)
    return nx.freeze(graph)  # cached and shared: edits must raise
