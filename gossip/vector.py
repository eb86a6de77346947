"""Vector operations on flat buffers, chunked so that no model-sized temporary is ever made."""

from __future__ import annotations

import numpy as np

CHUNK = 1 << 20  # elements per vector op


def all_finite(array: np.ndarray) -> bool:
    """True when no element is NaN or infinite."""
    flat = array.reshape(-1)
    return all(bool(np.isfinite(flat[i : i + CHUNK]).all()) for i in range(0, flat.size, CHUNK))


def scratch_for(array: np.ndarray) -> np.ndarray:
    """A buffer for :func:`add_scaled` on vectors like ``array``."""
    return np.empty(min(array.size, CHUNK), dtype=array.dtype)


def add_scaled(y: np.ndarray, x: np.ndarray, a: float, scratch: np.ndarray) -> None:
    """y += a * x, chunk by chunk through ``scratch``."""
    for i in range(0, y.size, scratch.size):
        part = scratch[: min(scratch.size, y.size - i)]
        np.multiply(x[i : i + part.size], a, out=part)
        y[i : i + part.size] += part
