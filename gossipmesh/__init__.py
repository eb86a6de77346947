"""gossipmesh: decentralized peer-to-peer training. The public API of a user's own training loop::

    import gossipmesh

    config = gossipmesh.node_config()                 # the daemon's options: flags, env, TOML
    with gossipmesh.Session(config, model, torch.optim.SGD(model.parameters(), lr=0.05)) as node:
        ...  # the loop, stepping node.optimizer: joined (or took the mesh's state), checkpoints
    # or piece by piece: peer = gossipmesh.connect(config, model);
    # gossipmesh.GossipOptimizer(sgd, peer=peer, algorithm=gossipmesh.Algorithm.parse("sgp"))

Strings become objects at one boundary, each type's ``parse`` (``Algorithm.parse("dpsgd:backup=1")``,
``Topology.parse("ring")``, ``Codec.parse("int8")``, ``RobustRule.parse("clip")``); every
constructor takes the objects. The programs live in subpackages: ``gossipmesh.daemon`` (a node's
runtime), ``gossipmesh.mesh`` (the local test mesh), ``gossipmesh.cli`` (the command line),
``gossipmesh.tasks`` (built-in tasks), ``gossipmesh.sim`` (the simulator), ``gossipmesh.config``.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gossip import (
        Algorithm,
        Codec,
        GossipOptimizer,
        GossipStatistics,
        IncompatibleOptionsError,
        PeerNetwork,
        RobustRule,
        choose_algorithm,
        consensus_distance,
    )
    from gossip.buffers.flat import host_vector
    from gossipmesh.config import ConfigError, MeshConfig, NodeConfig, node_config
    from gossipmesh.daemon.lifecycle import Session
    from gossipmesh.daemon.peers import connect
    from gossipmesh.tasks import (
        IID,
        Batches,
        DataPartition,
        Evaluation,
        Shard,
        Task,
        TaskRef,
        partition_indices,
    )
    from p2p import Peer
    from topologies import SpecError, Topology, member_order

#: where each public name lives; imported on first use (PEP 562): the command line imports this
#: package before it parses anything, and most of these import torch
_HOME = {
    **dict.fromkeys(
        (
            "Algorithm",
            "Codec",
            "GossipOptimizer",
            "GossipStatistics",
            "IncompatibleOptionsError",
            "PeerNetwork",
            "RobustRule",
            "choose_algorithm",
            "consensus_distance",
        ),
        "gossip",
    ),
    "host_vector": "gossip.buffers.flat",
    **dict.fromkeys(("ConfigError", "MeshConfig", "NodeConfig", "node_config"), "gossipmesh.config"),
    "Session": "gossipmesh.daemon.lifecycle",
    "connect": "gossipmesh.daemon.peers",
    **dict.fromkeys(
        ("IID", "Batches", "DataPartition", "Evaluation", "Shard", "Task", "TaskRef", "partition_indices"),
        "gossipmesh.tasks",
    ),
    "Peer": "p2p",
    **dict.fromkeys(("SpecError", "Topology", "member_order"), "topologies"),
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_HOME[name]), name)


__all__ = [
    "IID",
    "Algorithm",
    "Batches",
    "Codec",
    "ConfigError",
    "DataPartition",
    "Evaluation",
    "GossipOptimizer",
    "GossipStatistics",
    "IncompatibleOptionsError",
    "MeshConfig",
    "NodeConfig",
    "Peer",
    "PeerNetwork",
    "RobustRule",
    "Session",
    "Shard",
    "SpecError",
    "Task",
    "TaskRef",
    "Topology",
    "choose_algorithm",
    "connect",
    "consensus_distance",
    "host_vector",
    "member_order",
    "node_config",
    "partition_indices",
]
