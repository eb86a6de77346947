"""Graphs, mixing weights and schedules: pure functions of (topology, members, round). No I/O."""

from topologies.analysis import Analysis, analyze, second_eigenvalue_modulus
from topologies.graphs import TopologyError
from topologies.members import MixingRow, member_order, mixing_row, pair_partner
from topologies.schedules import active_passive, pairwise_partner
from topologies.spec import Params, Spec, SpecError
from topologies.topology import FAMILIES, NAMES, Topology
from topologies.weights import SCHEMES, check_column_stochastic, check_doubly_stochastic

__all__ = [
    "FAMILIES",
    "NAMES",
    "SCHEMES",
    "Analysis",
    "MixingRow",
    "Params",
    "Spec",
    "SpecError",
    "Topology",
    "TopologyError",
    "active_passive",
    "analyze",
    "check_column_stochastic",
    "check_doubly_stochastic",
    "member_order",
    "mixing_row",
    "pair_partner",
    "pairwise_partner",
    "second_eigenvalue_modulus",
]
