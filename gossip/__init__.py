"""Decentralized averaging. Opens no socket: algorithms talk to a ``PeerNetwork``."""

from gossip.adpsgd import ADPSGD
from gossip.algorithms import ALGORITHMS, Algorithm
from gossip.averager import Averager, IncompatibleOptionsError, Needs, RoundStats
from gossip.choco import CHOCO
from gossip.compression import CODECS, Codec, CodecError
from gossip.consensus import consensus_distance
from gossip.dpsgd import DPSGD
from gossip.flat import FlatParameters
from gossip.network import Envelope, PeerNetwork
from gossip.optimizer import GossipOptimizer, GossipStatistics
from gossip.outer import OuterNesterov
from gossip.robust import RobustRule
from gossip.sgp import SGP

__all__ = [
    "ADPSGD",
    "ALGORITHMS",
    "CHOCO",
    "CODECS",
    "DPSGD",
    "SGP",
    "Algorithm",
    "Averager",
    "Codec",
    "CodecError",
    "Envelope",
    "FlatParameters",
    "GossipOptimizer",
    "GossipStatistics",
    "IncompatibleOptionsError",
    "Needs",
    "OuterNesterov",
    "PeerNetwork",
    "RobustRule",
    "RoundStats",
    "consensus_distance",
]
