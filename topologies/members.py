"""Topology from membership: every node derives the same graph from the same member ids.

The live member ids are ordered with :func:`member_order` (natural sort, so ``node-2`` comes
before ``node-10``); a node's position in that order is its vertex in the topology's graph for
the round. Nodes that share a view therefore agree on every edge and weight with no
coordination, and a change of membership changes the graph for the next round.

Some graphs exist only for some sizes (a hypercube needs a power of two, a user file fixes n).
When members come or go and the topology is not defined for the new count, the row comes from
:data:`FALLBACK` (defined for every n, and still agreed by all nodes) until it is defined again,
so a departure never stops averaging.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

from topologies.graphs import TopologyError
from topologies.schedules import pairwise_partner
from topologies.topology import Topology

FALLBACK = Topology("exponential")
_DIGITS = re.compile(r"(\d+)")


@dataclass(frozen=True)
class MixingRow:
    """One node's part of one round: whom it sends to, and how it weighs what it receives."""

    self_weight: float
    receive_from: Mapping[str, float]
    send_to: tuple[str, ...]
    topology: Topology  # the one used: the requested one, or FALLBACK where it is not defined

    def renormalized(self, arrived: Iterable[str]) -> MixingRow:
        """The row restricted to the senders whose values arrived, scaled to sum to 1 again."""
        arrived = set(arrived)
        kept = {j: w for j, w in self.receive_from.items() if j in arrived}
        total = self.self_weight + sum(kept.values())
        weights = {j: w / total for j, w in kept.items()}
        return MixingRow(self.self_weight / total, weights, self.send_to, self.topology)


def member_order(members: Iterable[str]) -> list[str]:
    """Members in the order that maps them onto graph vertices 0..n-1."""
    return sorted(members, key=lambda m: [int(p) if p.isdigit() else p for p in _DIGITS.split(m)])


@lru_cache(maxsize=64)
def _positions(members: frozenset[str]) -> tuple[tuple[str, ...], Mapping[str, int]]:
    """The member order and each member's position in it, computed once per membership view
    (every node computes its row every round; at thousands of members sorting is the cost)."""
    ordered = tuple(member_order(members))
    return ordered, MappingProxyType({m: i for i, m in enumerate(ordered)})


def _vertices(members: Iterable[str], positions: Mapping[str, int]) -> frozenset[int]:
    """The graph vertices of those of ``members`` that are in the view."""
    return frozenset(positions[m] for m in members if m in positions)


def mixing_row(
    topology: Topology, members: Iterable[str], me: str, round: int = 0, no_listen: Iterable[str] = ()
) -> MixingRow:
    """``me``'s row among ``members`` in ``round`` (from :data:`FALLBACK` where ``topology``
    has no graph for this many members); ``no_listen``: members that accept no connection,
    never paired with one another."""
    ordered, positions = _positions(frozenset(members))
    if me not in positions:
        raise ValueError(f"{me!r} is not among the members {list(ordered)}")
    n, i = len(ordered), positions[me]
    hidden = _vertices(no_listen, positions)
    try:
        topology.graph(n, round)
    except TopologyError:
        topology = FALLBACK
    self_weight, row = topology.row(n, i, round, hidden)
    return MixingRow(
        self_weight=self_weight,
        receive_from={ordered[j]: w for j, w in row.items()},
        send_to=tuple(ordered[j] for j in topology.sends_to(n, i, round, hidden)),
        topology=topology,
    )


def pair_partner(
    topology: Topology, members: Iterable[str], me: str, round: int = 0, no_listen: Iterable[str] = ()
) -> str | None:
    """The passive neighbour ``me`` exchanges with in ``round`` when it is active (asynchronous
    pairwise gossip), or None when it is passive or has no passive neighbour (``no_listen``:
    as in :func:`mixing_row`)."""
    ordered, positions = _positions(frozenset(members))
    if me not in positions or len(ordered) < 2:
        return None
    hidden = _vertices(no_listen, positions)
    try:
        graph = topology.graph(len(ordered), 0, hidden)
    except TopologyError:
        graph = FALLBACK.graph(len(ordered), 0, hidden)
    partner = pairwise_partner(graph, positions[me], round)
    return None if partner is None else ordered[partner]
