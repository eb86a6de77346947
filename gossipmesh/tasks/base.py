"""What a training task provides, and the pieces every task shares."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from topologies.spec import Params, Spec, number

if TYPE_CHECKING:  # (a config holds a Precision and a DataPartition before it trains: torch is
    # imported where a model or a batch is made, not where a --dtype is parsed)
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

    def describe(self, partition: DataPartition) -> dict[str, Any]:
        """The run report's account of this shard: partition, examples, examples per label."""
        labels = self.labels if self.labels is not None else self.targets.numpy()
        summary: dict[str, Any] = {"partition": str(partition), "examples": len(self)}
        if labels.ndim == 1:
            values, counts = np.unique(labels, return_counts=True)
            summary["label_counts"] = {str(v): int(c) for v, c in zip(values, counts, strict=True)}
        return summary


class Task(Protocol):
    name: str

    def model(self, seed: int) -> nn.Module:
        """A fresh model; the same seed gives the same weights on every node."""
        ...

    def shard(self, rank: int, num_shards: int, *, partition: DataPartition, seed: int) -> Shard:
        """This node's part of the training data."""
        ...

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module) -> Evaluation:
        """Loss and accuracy on the held-out split every node shares."""
        ...


PRECISIONS = ("float32", "bfloat16", "float16", "mixed")


@dataclass(frozen=True)
class Precision:
    """What a model's parameters are held in (``--dtype``): ``float32``; ``bfloat16`` or
    ``float16``, every parameter; ``mixed``, weight matrices in bfloat16 and biases and norms
    in float32. A model narrower than float32 runs its forward passes under autocast, so a task
    written for float32 inputs trains and evaluates unchanged; gossip mixes every dtype in
    float32 and sends each at its own width (``gossip.buffers.flat``)."""

    name: str = "float32"

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The autocast dtype, or None for a float32 model."""
        import torch

        return {"float32": None, "float16": torch.float16}.get(self.name, torch.bfloat16)

    def apply(self, model: nn.Module) -> nn.Module:
        """``model`` with its parameters in this precision (in place)."""
        if self.name in ("bfloat16", "float16"):
            return model.to(self.compute_dtype)
        if self.name == "mixed":
            for param in model.parameters():
                if param.ndim >= 2:
                    param.data = param.data.to(self.compute_dtype)
        return model

    def autocast(self, device: torch.device) -> AbstractContextManager[object]:
        """The context a forward pass of the model runs in."""
        import torch

        dtype = self.compute_dtype
        return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def __str__(self) -> str:
        return self.name


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in evaluation mode (BatchNorm uses its running statistics and leaves them be,
    dropout is off), then back in the mode it was in."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def device_of(model: nn.Module) -> torch.device:
    """Where the model's parameters are: a task's evaluate moves its held-out data there."""
    return next(model.parameters()).device


class Batches:
    """Endless minibatches, reshuffled every pass over the shard, that can resume where they were:
    :meth:`position` is the generator state at the start of the current pass and the examples
    used in it, and ``Batches(..., resume=position)`` goes on from there; or, from a fresh start
    with the same seed, :meth:`skip` the batches drawn before (a machine's other ranks, which
    draw in step with its rank 0 and keep no checkpoint)."""

    def __init__(
        self, shard: Shard, batch_size: int, seed: int, resume: tuple[torch.Tensor, int] | None = None
    ) -> None:
        if len(shard) == 0:
            raise ValueError("this node's shard has no examples; use fewer nodes or a larger ALPHA")
        self._shard = shard
        self._size = min(batch_size, len(shard))
        import torch

        self._generator = torch.Generator().manual_seed(seed)
        self._new_pass()
        self.drawn = 0  # batches drawn by this object (not skipped)
        if resume is not None:
            state, used = resume
            self._generator.set_state(state)
            self._new_pass()
            self._used = used

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._used + self._size > len(self._order):
            self._new_pass()
        index = self._order[self._used : self._used + self._size]
        self._used += self._size
        self.drawn += 1
        return self._shard.inputs[index], self._shard.targets[index]

    def skip(self, count: int) -> None:
        """Go on as if ``count`` more batches had been drawn (a pass at a time, no data touched)."""
        while count > 0:
            if self._used + self._size > len(self._order):
                self._new_pass()
            taken = min(count, (len(self._order) - self._used) // self._size)
            self._used += taken * self._size
            count -= taken

    def position(self) -> tuple[torch.Tensor, int]:
        return self._pass_start.clone(), self._used

    def _new_pass(self) -> None:
        import torch

        self._pass_start = self._generator.get_state()
        self._order = torch.randperm(len(self._shard), generator=self._generator)
        self._used = 0


_PARTITIONS = {
    "iid": Params(),
    "dirichlet": Params({"alpha": number(float, above=0)}, positional="alpha", required=("alpha",)),
}


@dataclass(frozen=True)
class DataPartition(Spec, what="partition", choices=_PARTITIONS):
    """How the training examples are split over nodes: ``iid`` (a seeded shuffle cut into equal
    parts) or ``dirichlet:ALPHA`` (label skew: each class spread over the shards in proportions
    drawn from Dirichlet(ALPHA); small ALPHA, more skew)."""


IID = DataPartition("iid")


def partition_indices(
    labels: np.ndarray, num_shards: int, partition: DataPartition, seed: int
) -> list[np.ndarray]:
    """Split example indices into ``num_shards`` parts as ``partition`` says."""
    rng = np.random.default_rng(seed)
    if partition.name == "iid":
        return [np.sort(part) for part in np.array_split(rng.permutation(len(labels)), num_shards)]
    alpha = partition.options["alpha"]
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        cuts = (np.cumsum(rng.dirichlet([alpha] * num_shards)) * len(members)).astype(int)[:-1]
        for shard, part in zip(shards, np.split(members, cuts), strict=True):
            shard.extend(part.tolist())
    return [np.sort(np.array(s, dtype=np.int64)) for s in shards]
