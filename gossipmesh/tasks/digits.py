"""The built-in task: an MLP on scikit-learn's bundled 8x8 digits (no download).

The data file is read straight from the installed scikit-learn package: importing scikit-learn
itself would add seconds to every node's start.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from gossipmesh.tasks.base import DataPartition, Evaluation, Shard, device_of, evaluating, partition_indices

SPLIT_SEED = 0
TEST_FRACTION = 0.2


def digits_file() -> Path:
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.exists():
        raise FileNotFoundError("the digits task needs scikit-learn: pip install scikit-learn")
    return path


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices, each class split in the same proportion (seeded).

    The test split has ceil(n * test_fraction) examples, given out per class by largest
    remainder so every class keeps its share.
    """
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    ideal = counts * test_fraction
    per_class = np.floor(ideal).astype(int)
    shortfall = math.ceil(len(labels) * test_fraction) - per_class.sum()
    per_class[np.argsort(-(ideal - per_class), kind="stable")[:shortfall]] += 1
    train, test = [], []
    for label, cut in zip(classes, per_class, strict=True):
        members = rng.permutation(np.flatnonzero(labels == label))
        test.append(members[:cut])
        train.append(members[cut:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


class DigitsTask:
    """64-128-10 ReLU MLP; inputs scaled to [0, 1]; a stratified 80/20 split with a fixed seed."""

    name = "digits"

    def __init__(self) -> None:
        table = np.loadtxt(digits_file(), delimiter=",", dtype=np.float32)
        inputs = torch.from_numpy(table[:, :-1] / 16.0)
        labels = table[:, -1].astype(np.int64)
        train, test = stratified_split(labels, TEST_FRACTION, SPLIT_SEED)
        self._train_x, self._train_y = inputs[train], torch.from_numpy(labels[train])
        self._test_x, self._test_y = inputs[test], torch.from_numpy(labels[test])

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def shard(self, rank: int, num_shards: int, *, partition: DataPartition, seed: int) -> Shard:
        parts = partition_indices(self._train_y.numpy(), num_shards, partition, seed)
        index = torch.from_numpy(parts[rank])
        return Shard(self._train_x[index], self._train_y[index])

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return functional.cross_entropy(model(inputs), targets)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> Evaluation:
        device = device_of(model)
        inputs, targets = self._test_x.to(device), self._test_y.to(device)
        with evaluating(model):
            logits = model(inputs)
        return Evaluation(
            loss=float(functional.cross_entropy(logits, targets)),
            accuracy=float((logits.argmax(dim=1) == targets).float().mean()),
        )
