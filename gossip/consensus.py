"""How far apart the nodes' models are."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def consensus_distance(vectors: Sequence[np.ndarray]) -> float:
    """mean_i ||x_i - x̄|| / ||x̄||: 0 when every node holds the same model."""
    if not vectors:
        raise ValueError("consensus distance of no vectors")
    stacked = np.stack([np.asarray(v, dtype=np.float64).reshape(-1) for v in vectors])
    mean = stacked.mean(axis=0)
    norm = np.linalg.norm(mean)
    if norm == 0.0:
        raise ValueError("consensus distance is undefined when the mean vector is zero")
    return float(np.linalg.norm(stacked - mean, axis=1).mean() / norm)


def relative_distance(vector: np.ndarray, reference: np.ndarray) -> float:
    """||vector - reference|| / ||vector|| (0 for a zero vector equal to its reference)."""
    norm = float(np.linalg.norm(vector))
    distance = float(np.linalg.norm(vector - reference))
    return distance / norm if norm else distance
