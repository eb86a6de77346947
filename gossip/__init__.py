"""Decentralized averaging. Opens no socket: algorithms talk to a ``PeerNetwork``."""

from gossip.consensus import consensus_distance
from gossip.dpsgd import DPSGD, RoundStats
from gossip.flat import FlatParameters
from gossip.network import Envelope, PeerNetwork
from gossip.optimizer import ALGORITHMS, GossipOptimizer

__all__ = [
    "ALGORITHMS",
    "DPSGD",
    "Envelope",
    "FlatParameters",
    "GossipOptimizer",
    "PeerNetwork",
    "RoundStats",
    "consensus_distance",
]
