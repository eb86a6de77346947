"""Vector operations on flat buffers, chunked so that no model-sized temporary is ever made."""

from __future__ import annotations

import numpy as np

from gossip.arrays import Array, array_module

CHUNK = 1 << 20  # elements per vector op


def all_finite(array: np.ndarray) -> bool:
    """True when no element is NaN or infinite."""
    flat = array.reshape(-1)
    return all(bool(np.isfinite(flat[i : i + CHUNK]).all()) for i in range(0, flat.size, CHUNK))


def scratch_for(array: Array) -> Array:
    """A buffer for :func:`add_scaled` on vectors like ``array`` (on its device)."""
    return array_module(array).empty(min(array.size, CHUNK), dtype=array.dtype)


def add_scaled(y: Array, x: Array, a: float, scratch: Array) -> None:
    """y += a * x, chunk by chunk through ``scratch`` (numpy or cupy arrays alike)."""
    xp = array_module(y)
    for i in range(0, y.size, scratch.size):
        part = scratch[: min(scratch.size, y.size - i)]
        xp.multiply(x[i : i + part.size], a, out=part)
        y[i : i + part.size] += part
