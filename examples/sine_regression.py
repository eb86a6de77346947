"""Your own model in your own training loop, averaged with a mesh: the loop runs inside a
``gossipmesh.Session`` (join, or take a running mesh's state; checkpoints with --state-dir; a
clean leave) and steps the session's optimizer.

Run two nodes (options are those of ``gossipmesh node``: flags, GOSSIPMESH_* or --config)::

    gossipmesh keygen /tmp/sine-keys --name mesh
    python examples/sine_regression.py --listen tcp://127.0.0.1:7001 --expect 2 \
        --keys /tmp/sine-keys --trusted /tmp/sine-keys --steps 600 &
    python examples/sine_regression.py --listen tcp://127.0.0.1:7002 --expect 2 \
        --keys /tmp/sine-keys --trusted /tmp/sine-keys --steps 600 --bootstrap tcp://127.0.0.1:7001

The same task also runs in the daemon, which calls ``make_task`` (from this folder)::

    gossipmesh mesh --task sine_regression:make_task --partition dirichlet:0.5
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

import gossipmesh
from gossipmesh import Batches, DataPartition, Evaluation, Shard, partition_indices

EXAMPLES = 4096
TOLERANCE = 0.1  # a prediction this close to the target counts as accurate


class SineRegressor(nn.Module):
    """A user's model: y = sin(3 x0) + x1^2 from two inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs).squeeze(-1)


def _examples(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.rand(count, 2, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return inputs, torch.sin(3 * inputs[:, 0]) + inputs[:, 1] ** 2


class SineTask:
    """What ``--task module:function`` needs: model, shards, loss, held-out evaluation."""

    name = "sine"

    def __init__(self) -> None:
        self._inputs, self._targets = _examples(EXAMPLES, seed=1)
        self._test_inputs, self._test_targets = _examples(512, seed=2)
        # labels for dirichlet:ALPHA partitioning: the quadrant of the input
        self._quadrants = ((self._inputs[:, 0] > 0) * 2 + (self._inputs[:, 1] > 0)).numpy()

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return SineRegressor()

    def shard(self, rank: int, num_shards: int, *, partition: DataPartition, seed: int) -> Shard:
        part = partition_indices(self._quadrants, num_shards, partition, seed)[rank]
        index = torch.from_numpy(part)
        return Shard(self._inputs[index], self._targets[index], labels=self._quadrants[part])

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(inputs), targets)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> Evaluation:
        predictions = model(self._test_inputs)
        return Evaluation(
            loss=float(nn.functional.mse_loss(predictions, self._test_targets)),
            accuracy=float(((predictions - self._test_targets).abs() < TOLERANCE).float().mean()),
        )


def make_task() -> SineTask:
    return SineTask()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train one node; print and return its figures."""
    config = gossipmesh.node_config(argv)  # the daemon's options: flags, GOSSIPMESH_*, --config
    if config.threads:
        torch.set_num_threads(config.threads)
    task = make_task()
    model = task.model(config.seed)
    before = task.evaluate(model)

    # your optimizer, averaging as the flags say (--algorithm, --topology, --compression...)
    local = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    with gossipmesh.Session(config, model, local) as node:  # joined (or took the mesh's state)
        optimizer, rank = node.optimizer, node.rank
        shard = task.shard(rank, len(node.members), partition=config.partition, seed=config.seed)
        steps = config.steps or math.inf
        for step, (inputs, targets) in enumerate(Batches(shard, config.batch_size, seed=config.seed + rank)):
            if step == steps:
                break
            loss = task.loss(model, inputs, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # a local step, then a gossip round with the neighbours
    # (here the node has left the mesh after its last round)

    after = task.evaluate(model)
    if config.save_params is not None:
        np.save(config.save_params, optimizer.flat.array)
    summary = {
        "id": node.node_id,
        "rank": rank,
        "rounds": optimizer.round,
        "seconds": optimizer.statistics().phase_seconds,  # where the time went: compute, wait...
        "loss_before": before.loss,
        "loss_after": after.loss,
        "accuracy": after.accuracy,
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
