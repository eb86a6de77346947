"""Decentralized averaging. Opens no socket: algorithms talk to a ``PeerNetwork``."""

from gossip.adpsgd import ADPSGD
from gossip.algorithms import ALGORITHMS, Algorithm, AlgorithmError
from gossip.averager import Averager, RoundStats
from gossip.choco import CHOCO
from gossip.compression import CODECS, Codec, CodecError, parse_codec
from gossip.consensus import consensus_distance
from gossip.dpsgd import DPSGD
from gossip.flat import FlatParameters
from gossip.network import Envelope, PeerNetwork
from gossip.optimizer import GossipOptimizer
from gossip.outer import OuterNesterov
from gossip.sgp import SGP

__all__ = [
    "ADPSGD",
    "ALGORITHMS",
    "CHOCO",
    "CODECS",
    "DPSGD",
    "SGP",
    "Algorithm",
    "AlgorithmError",
    "Averager",
    "Codec",
    "CodecError",
    "Envelope",
    "FlatParameters",
    "GossipOptimizer",
    "OuterNesterov",
    "PeerNetwork",
    "RoundStats",
    "consensus_distance",
    "parse_codec",
]
