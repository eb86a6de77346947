"""A training workload for small simulated meshes: each node trains a real task's model through
the daemon's ``GossipOptimizer``; only the time its steps take is virtual."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from gossip import GossipOptimizer
from gossipmesh.sim.links import VirtualPeer
from gossipmesh.sim.run import NodeFactory, SimNode
from gossipmesh.tasks import IID, Batches, Task

MakeOptimizer = Callable[[torch.nn.Module, VirtualPeer], GossipOptimizer]


def training(task: Task, nodes: int, optimizer: MakeOptimizer, *, batch_size: int, seed: int) -> NodeFactory:
    """Node i trains on shard i of ``nodes`` (iid) from the seed's model, with the optimizer
    ``optimizer(model, peer)`` makes (the daemon's, from the same options); a joiner starts
    from the model it is given (its shard is the one of its index modulo ``nodes``)."""

    def build(peer: VirtualPeer, index: int, start: np.ndarray | None) -> SimNode:
        model = task.model(seed)
        gossip = optimizer(model, peer)
        if start is not None:
            gossip.flat.array[:] = start
        shard = task.shard(index % nodes, nodes, partition=IID, seed=seed)
        stream = Batches(shard, batch_size, seed=seed + index)

        def step() -> bool:
            inputs, targets = next(stream)
            loss = task.loss(model, inputs, targets)
            gossip.zero_grad()
            loss.backward()
            gossip.step()
            return gossip.round_ran

        return SimNode(gossip.flat.array, gossip.averager, step, lambda: task.evaluate(model).accuracy)

    return build


def model_nbytes(task: Task, seed: int) -> int:
    return sum(p.numel() * p.element_size() for p in task.model(seed).parameters())


def averaging_through(vectors: np.ndarray, optimizer: MakeOptimizer) -> NodeFactory:
    """Pure averaging through the optimizer layer, so every averaging option applies: node i's
    model is one float32 parameter (as a model's, which every codec takes), ``vectors[i]``, that
    no gradient moves (its steps only count towards the gossip rounds)."""

    def build(peer: VirtualPeer, index: int, start: np.ndarray | None) -> SimNode:
        vector = torch.tensor(vectors[index] if start is None else start, dtype=torch.float32)
        model = torch.nn.ParameterList([torch.nn.Parameter(vector)])
        gossip = optimizer(model, peer)

        def step() -> bool:
            gossip.step()
            return gossip.round_ran

        return SimNode(gossip.flat.array, gossip.averager, step)

    return build
