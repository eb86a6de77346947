"""What a training task provides, and the pieces every task shares."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class Evaluation:
    loss: float
    accuracy: float


@dataclass(frozen=True)
class Shard:
    """One node's training examples; ``labels``: what the partition split by (one per example;
    default: the targets, when they are class labels)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    labels: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.targets)

    def describe(self, partition: str) -> dict[str, Any]:
        """The run report's account of this shard: partition, examples, examples per label."""
        labels = self.labels if self.labels is not None else self.targets.numpy()
        summary: dict[str, Any] = {"partition": partition, "examples": len(self)}
        if labels.ndim == 1:
            values, counts = np.unique(labels, return_counts=True)
            summary["label_counts"] = {str(v): int(c) for v, c in zip(values, counts, strict=True)}
        return summary


class Task(Protocol):
    name: str

    def model(self, seed: int) -> nn.Module:
        """A fresh model; the same seed gives the same weights on every node."""
        ...

    def shard(self, rank: int, num_shards: int, *, partition: str, seed: int) -> Shard:
        """This node's part of the training data."""
        ...

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module) -> Evaluation:
        """Loss and accuracy on the held-out split every node shares."""
        ...


def batches(shard: Shard, batch_size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless minibatches, reshuffled every pass over the shard."""
    if len(shard) == 0:
        raise ValueError("this node's shard has no examples; use fewer nodes or a larger ALPHA")
    generator = torch.Generator().manual_seed(seed)
    size = min(batch_size, len(shard))
    while True:
        order = torch.randperm(len(shard), generator=generator)
        for start in range(0, len(order) - size + 1, size):
            index = order[start : start + size]
            yield shard.inputs[index], shard.targets[index]


def partition_indices(labels: np.ndarray, num_shards: int, partition: str, seed: int) -> list[np.ndarray]:
    """Split example indices into ``num_shards`` parts.

    ``iid``: a seeded shuffle cut into equal parts. ``dirichlet:ALPHA``: label skew, each class
    spread over the shards in proportions drawn from Dirichlet(ALPHA) (small ALPHA, more skew).
    """
    rng = np.random.default_rng(seed)
    if partition == "iid":
        return [np.sort(part) for part in np.array_split(rng.permutation(len(labels)), num_shards)]
    alpha = parse_dirichlet(partition)
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        cuts = (np.cumsum(rng.dirichlet([alpha] * num_shards)) * len(members)).astype(int)[:-1]
        for shard, part in zip(shards, np.split(members, cuts), strict=True):
            shard.extend(part.tolist())
    return [np.sort(np.array(s, dtype=np.int64)) for s in shards]


def parse_dirichlet(partition: str) -> float:
    """ALPHA of ``dirichlet:ALPHA``; raises ValueError with the accepted forms."""
    name, _, value = partition.partition(":")
    try:
        alpha = float(value)
    except ValueError:
        alpha = math.nan
    if name != "dirichlet" or not alpha > 0 or math.isinf(alpha):
        raise ValueError(f"partition {partition!r}: use 'iid' or 'dirichlet:ALPHA' with ALPHA > 0")
    return alpha
