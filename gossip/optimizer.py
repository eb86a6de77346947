"""The training-loop wrapper: a local optimizer step, then a gossip round every few steps."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from gossip.dpsgd import DPSGD, RoundStats
from gossip.flat import FlatParameters
from gossip.network import PeerNetwork
from topologies import Topology

ALGORITHMS = ("dpsgd",)


class GossipOptimizer:
    """Drop-in for a torch optimizer in a decentralized mesh::

        opt = GossipOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), peer=peer)
        loss.backward(); opt.step(); opt.zero_grad()

    Args:
        optimizer: the local optimizer; its parameters are moved into one flat buffer.
        peer: the node's network (``p2p.Peer``).
        algorithm: the averaging algorithm, one of ``ALGORITHMS``.
        topology: the graph to average on: a ``topologies.Topology`` or its spelling
            (``"ring"``, ``"random-regular:degree=4"``, ``"file:graph.json"``...).
        average_every: local steps between gossip rounds.
        round_timeout: the longest a round waits for a neighbour, in seconds.
        lock: held while parameters are written (local step and mixing), so another thread can
            evaluate the model consistently.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        peer: PeerNetwork,
        algorithm: str = "dpsgd",
        topology: Topology | str = "ring",
        average_every: int = 1,
        round_timeout: float = 2.0,
        lock: AbstractContextManager[object] | None = None,
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
        if average_every < 1:
            raise ValueError(f"average_every must be >= 1, got {average_every}")
        self.optimizer = optimizer
        self.average_every = average_every
        self.local_steps = 0
        self.last_round: RoundStats | None = None
        self._lock = lock if lock is not None else contextlib.nullcontext()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.flat = FlatParameters(params)
        self.averager = DPSGD(
            peer,
            self.flat.array,
            topology=topology if isinstance(topology, Topology) else Topology.parse(topology),
            round_timeout=round_timeout,
            lock=lock,
        )

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        with self._lock:
            loss = self.optimizer.step(closure)
        self.local_steps += 1
        if self.local_steps % self.average_every == 0:
            self.last_round = self.averager.average()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
