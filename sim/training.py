"""A training workload for small simulated meshes: each node trains a real task's model through
the daemon's ``GossipOptimizer``; only the time its steps take is virtual."""

from __future__ import annotations

import numpy as np
import torch

from gossip import Algorithm, Codec, GossipOptimizer
from sim.network import VirtualPeer
from sim.run import NodeFactory, SimNode
from tasks import Batches, Task
from topologies import Topology

LR, MOMENTUM, BATCH = 0.05, 0.9, 32  # the daemon's defaults


def training(
    task: Task,
    nodes: int,
    algorithm: Algorithm,
    topology: Topology,
    round_timeout: float,
    codec: Codec,
    seed: int,
) -> NodeFactory:
    """Node i trains on shard i of ``nodes`` (iid) from the seed's model; a joiner starts from
    the model it is given (its shard is the one of its index modulo ``nodes``)."""

    def build(peer: VirtualPeer, index: int, start: np.ndarray | None) -> SimNode:
        model = task.model(seed)
        optimizer = GossipOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
            peer=peer,
            algorithm=algorithm,
            topology=topology,
            round_timeout=round_timeout,
            compression=codec,
        )
        if start is not None:
            optimizer.flat.array[:] = start
        shard = task.shard(index % nodes, nodes, partition="iid", seed=seed)
        stream = Batches(shard, BATCH, seed=seed + index)

        def step() -> None:
            inputs, targets = next(stream)
            loss = task.loss(model, inputs, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        return SimNode(optimizer.flat.array, optimizer.averager, step, lambda: task.evaluate(model).accuracy)

    return build


def model_nbytes(task: Task, seed: int) -> int:
    return sum(p.numel() * p.element_size() for p in task.model(seed).parameters())
