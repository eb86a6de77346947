"""Decentralized averaging. Opens no socket: algorithms talk to a ``PeerNetwork``."""

from gossip.adpsgd import ADPSGD
from gossip.algorithms import ALGORITHMS, Algorithm, AlgorithmError
from gossip.averager import Averager, RoundStats
from gossip.consensus import consensus_distance
from gossip.dpsgd import DPSGD
from gossip.flat import FlatParameters
from gossip.network import Envelope, PeerNetwork
from gossip.optimizer import GossipOptimizer
from gossip.sgp import SGP

__all__ = [
    "ADPSGD",
    "ALGORITHMS",
    "DPSGD",
    "SGP",
    "Algorithm",
    "AlgorithmError",
    "Averager",
    "Envelope",
    "FlatParameters",
    "GossipOptimizer",
    "PeerNetwork",
    "RoundStats",
    "consensus_distance",
]
