"""Topology from membership: every node derives the same graph from the same member ids.

The live member ids are ordered with :func:`member_order` (natural sort, so ``node-2`` comes
before ``node-10``); a node's position in that order is its vertex in the named graph. Nodes
that share a view therefore agree on every edge and weight with no coordination, and a change
of membership changes the graph for the next round.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from topologies.graphs import build
from topologies.weights import metropolis_hastings

_DIGITS = re.compile(r"(\d+)")


@dataclass(frozen=True)
class MixingRow:
    """One node's row of the mixing matrix for one round."""

    self_weight: float
    neighbors: Mapping[str, float]


def member_order(members: Iterable[str]) -> list[str]:
    """Members in the order that maps them onto graph vertices 0..n-1."""
    return sorted(members, key=lambda m: [int(p) if p.isdigit() else p for p in _DIGITS.split(m)])


def mixing_row(topology: str, members: Iterable[str], me: str, round: int = 0) -> MixingRow:
    """``me``'s neighbours and mixing weights among ``members`` in ``round``."""
    ordered = member_order(members)
    if me not in ordered:
        raise ValueError(f"{me!r} is not among the members {ordered}")
    weights = mixing_matrix(topology, len(ordered))
    i = ordered.index(me)
    neighbors = {ordered[j]: float(weights[i, j]) for j in np.flatnonzero(weights[i]) if j != i}
    return MixingRow(self_weight=float(weights[i, i]), neighbors=neighbors)


@lru_cache(maxsize=64)
def mixing_matrix(topology: str, n: int) -> np.ndarray:
    """The Metropolis–Hastings matrix of the named graph on n nodes (cached, read-only)."""
    weights = metropolis_hastings(build(topology, n))
    weights.flags.writeable = False
    return weights
