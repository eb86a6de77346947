"""Decentralized averaging. Opens no socket: algorithms talk to a ``PeerNetwork``."""

from typing import TYPE_CHECKING, Any

from gossip.algorithms.adpsgd import ADPSGD
from gossip.algorithms.averager import Averager, IncompatibleOptionsError, Needs, RoundStats
from gossip.algorithms.choco import CHOCO
from gossip.algorithms.dpsgd import DPSGD
from gossip.algorithms.registry import ALGORITHMS, Algorithm, choose_algorithm
from gossip.algorithms.robust import RobustRule
from gossip.algorithms.sgp import SGP
from gossip.compression import CODECS, Codec, CodecError
from gossip.consensus import consensus_distance
from gossip.network import Envelope, PeerNetwork

if TYPE_CHECKING:
    from gossip.buffers.flat import FlatParameters
    from gossip.optim.optimizer import GossipOptimizer, GossipStatistics
    from gossip.optim.outer import OuterNesterov

#: the names that import torch, imported on first use (PEP 562) so that parsing an algorithm,
#: a codec or a topology does not pay for torch
_NEEDS_TORCH = {
    "FlatParameters": "gossip.buffers.flat",
    "GossipOptimizer": "gossip.optim.optimizer",
    "GossipStatistics": "gossip.optim.optimizer",
    "OuterNesterov": "gossip.optim.outer",
}


def __getattr__(name: str) -> Any:
    if name not in _NEEDS_TORCH:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_NEEDS_TORCH[name]), name)


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
    "choose_algorithm",
    "consensus_distance",
]
