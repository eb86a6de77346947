"""Graphs and mixing weights: pure functions of (name, members, round). No I/O."""

from topologies.graphs import BUILDERS, TopologyError, build
from topologies.membership import MixingRow, member_order, mixing_matrix, mixing_row
from topologies.weights import check_doubly_stochastic, metropolis_hastings

NAMES = tuple(BUILDERS)

__all__ = [
    "NAMES",
    "MixingRow",
    "TopologyError",
    "build",
    "check_doubly_stochastic",
    "member_order",
    "metropolis_hastings",
    "mixing_matrix",
    "mixing_row",
]
