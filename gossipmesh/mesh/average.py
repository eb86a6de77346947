"""The mesh's average model: the mean of the nodes' parameter vectors, scored on the task's
held-out split. At the end from the finished nodes' final models (the report's
``average_model``); during the run from the copies each node rewrites about once a second
(``--live-params``), for models of up to ``LIVE_MAX_BYTES``: the live table's header and the
report's ``average_model_timeline``. Each estimate also says how far each node's model is from
the average (``||x_i - mean|| / ||mean||``): a slow node's model kept current by mixing stays
close, however few steps it takes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gossip.buffers.flat import host_vector_bytes
from gossipmesh.config import MeshConfig

LIVE_MAX_BYTES = 16 << 20  # a larger model's nodes write no live copies: too dear each second
LIVE_EVERY_S = 1.0  # the launcher's estimates are at least this far apart...
LIVE_CPU_SHARE = 0.05  # ...and further where scoring one takes more than this share of the time


class AverageModel:
    """The task's model, to load a mean vector into and evaluate (on the launcher's CPU, on
    one thread: the launcher shares the cores with its nodes while they train)."""

    def __init__(self, config: MeshConfig) -> None:
        torch.set_num_threads(1)
        self._task = config.task.make()
        self._dtype = config.dtype
        self._model = config.dtype.apply(self._task.model(config.seed))
        self.size = sum(p.numel() for p in self._model.parameters())
        self.live = host_vector_bytes(self._model.parameters()) <= LIVE_MAX_BYTES

    def evaluate(self, vectors: Sequence[np.ndarray]) -> dict[str, float] | None:
        """Held-out loss and accuracy of the mean of ``vectors`` (None for none)."""
        return self.score(np.mean(vectors, axis=0)) if vectors else None

    def score(self, vector: np.ndarray) -> dict[str, float]:
        """Held-out loss and accuracy of the model ``vector`` holds."""
        mean = torch.from_numpy(vector)
        offset = 0
        with torch.no_grad():
            for param in self._model.parameters():  # (the order of gossip.buffers.flat.host_vector)
                param.copy_(mean[offset : offset + param.numel()].view_as(param))
                offset += param.numel()
            with self._dtype.autocast(torch.device("cpu")):
                evaluation = self._task.evaluate(self._model)
        return {"loss": round(evaluation.loss, 6), "accuracy": round(evaluation.accuracy, 6)}


class LiveAverage:
    """Estimates of the average model during the run, from the live nodes' latest copies;
    ``origin``: the mesh clock's zero (``time.time()``), each estimate's ``t`` being the mean
    time the copies it averages were written."""

    def __init__(self, model: AverageModel, origin: float) -> None:
        self._model = model
        self._origin = origin
        self._next_at = time.monotonic() + LIVE_EVERY_S
        # {"t", "loss", "accuracy", "nodes", "distance_from_average": {node: distance}}
        self.timeline: list[dict[str, Any]] = []

    def poll(self, paths: Mapping[str, Path]) -> dict[str, Any] | None:
        """A new estimate from each node's copy (``paths``: by node id) when one is due and a
        copy exists (else the last one, or None)."""
        started = time.monotonic()
        if started >= self._next_at:
            copies = {node: c for node, path in paths.items() if (c := self._read(path)) is not None}
            if copies:
                vectors = {node: vector for node, (vector, _) in copies.items()}
                mean = np.mean(list(vectors.values()), axis=0)
                written = float(np.mean([at for _, at in copies.values()])) - self._origin
                entry = {"t": round(written, 3), **self._model.score(mean), "nodes": len(copies)}
                self.timeline.append({**entry, "distance_from_average": distances_from(vectors, mean)})
            took = time.monotonic() - started
            self._next_at = started + max(LIVE_EVERY_S, took / LIVE_CPU_SHARE)
        return self.timeline[-1] if self.timeline else None

    def _read(self, path: Path) -> tuple[np.ndarray, float] | None:
        """A node's latest copy and when it was written; None before its first (or if it is
        not a whole vector of this model: every copy replaces the last whole, so only a node
        writing something else)."""
        try:
            written = path.stat().st_mtime
            vector = np.load(path, allow_pickle=False)
        except (OSError, ValueError):
            return None
        return (vector, written) if vector.shape == (self._model.size,) else None


def distances_from(vectors: Mapping[str, np.ndarray], mean: np.ndarray) -> dict[str, float]:
    """How far each node's model (by node id) is from ``mean``: ||x_i - mean|| / ||mean||."""
    norm = float(np.linalg.norm(mean)) or 1.0
    return {node: round(float(np.linalg.norm(vector - mean)) / norm, 8) for node, vector in vectors.items()}
