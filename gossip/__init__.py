"""Decentralized averaging. Opens no socket: algorithms talk to a ``PeerNetwork``."""

from gossip.algorithms.adpsgd import ADPSGD
from gossip.algorithms.averager import Averager, IncompatibleOptionsError, Needs, RoundStats
from gossip.algorithms.choco import CHOCO
from gossip.algorithms.dpsgd import DPSGD
from gossip.algorithms.registry import ALGORITHMS, Algorithm
from gossip.algorithms.robust import RobustRule
from gossip.algorithms.sgp import SGP
from gossip.buffers.flat import FlatParameters
from gossip.compression import CODECS, Codec, CodecError
from gossip.consensus import consensus_distance
from gossip.network import Envelope, PeerNetwork
from gossip.optim.optimizer import GossipOptimizer, GossipStatistics
from gossip.optim.outer import OuterNesterov

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
