"""Vector operations on flat buffers, chunked so that no model-sized temporary is ever made, and
the wire layout of a model's vector.

Mixing works on one vector of float32 (float64 for a float64 model): a model in bfloat16 or
float16, or one that mixes dtypes, is mixed in float32 and rounded once, when the result is
written back into it (``gossip.buffers.flat``). Where a message carries model values, it carries them as
the model holds them (:class:`Layout`): one frame per dtype bucket, bfloat16 in 2 bytes.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from gossip.buffers.arrays import Array, array_module

CHUNK = 1 << 20  # elements per vector op
HOST_BLOCK = 1 << 16  # elements worked on at a time on the host where several passes go (block_size)
Frames = Sequence[np.ndarray]  # a vector on the wire: one frame per bucket of its Layout
if TYPE_CHECKING:
    BFLOAT16: np.dtype  # numpy has none: ml_dtypes' (the one JAX uses), made by __getattr__


def __getattr__(name: str) -> np.dtype:
    """``BFLOAT16`` on first use (see :func:`dtype_named`)."""
    if name != "BFLOAT16":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return dtype_named("bfloat16")


def dtype_named(name: str) -> np.dtype:
    """The numpy dtype called ``name``. bfloat16 is ml_dtypes', imported only for it: that takes
    a second, which a command that only parses its options, or a float32 node, should not pay."""
    if name != "bfloat16":
        return np.dtype(name)
    import ml_dtypes

    bfloat16: np.dtype = np.dtype(ml_dtypes.bfloat16)
    return bfloat16


def all_finite(array: Array) -> bool:
    """True when no element is NaN or infinite (chunk by chunk, numpy or cupy alike)."""
    xp = array_module(array)
    flat = array.reshape(-1)
    return all(bool(xp.isfinite(flat[i : i + CHUNK]).all()) for i in range(0, flat.size, CHUNK))


def squared_distance(a: Array, b: Array) -> float:
    """|a - b|², chunk by chunk (numpy or cupy arrays alike)."""
    xp = array_module(a)
    total = 0.0
    for i in range(0, a.size, CHUNK):
        difference = xp.subtract(a[i : i + CHUNK], b[i : i + CHUNK])
        total += float(xp.vdot(difference, difference))
    return total


def mixing_dtype(dtype: np.dtype) -> np.dtype:
    """What a vector of ``dtype`` is mixed in, a block at a time: float32 or float64 as they
    are; float32 for a narrower model mixed in its own memory (``gossip.buffers.flat``)."""
    return np.dtype(dtype) if dtype in (np.float32, np.float64) else np.dtype(np.float32)


def block_size(array: Array) -> int:
    """Elements of ``array`` worked on at a time where several passes go over them (a mix, a
    codec's span): on the host few enough that the passes' operands stay in a core's L2 cache
    (over 25M float32 elements on this project's 2-core machine, add_scaled 0.018 s and CHOCO's
    mix 0.037 s at 2^16, against 0.026 and 0.051 at 2^18); on a device CHUNK (fewer kernel
    launches)."""
    return HOST_BLOCK if isinstance(array, np.ndarray) else CHUNK


def scratch_for(array: Array) -> Array:
    """A buffer for :func:`add_scaled` on vectors like ``array`` (on its device)."""
    return array_module(array).empty(min(array.size, block_size(array)), dtype=mixing_dtype(array.dtype))


def mix_into(target: Array, block: Array, keep: float = 1.0) -> None:
    """target <- keep * target + block (``block``, a scratch block, may be overwritten). A
    target narrower than the block (a bfloat16 model mixed in its own memory) is computed in
    the block's dtype and rounded into once."""
    if target.dtype == block.dtype:
        if keep != 1.0:
            target *= keep
        target += block
        return
    block += array_module(target).multiply(target, keep, dtype=block.dtype)
    array_module(target).copyto(target, block, casting="same_kind")


def add_scaled(y: Array, x: Array, a: float, scratch: Array) -> None:
    """y += a * x, chunk by chunk through ``scratch`` (numpy or cupy arrays alike); an ``x`` of
    another dtype than the scratch (a bfloat16 frame) is widened to it before it is scaled."""
    xp = array_module(y)
    for i in range(0, y.size, scratch.size):
        part = scratch[: min(scratch.size, y.size - i)]
        if x.dtype == part.dtype:
            xp.multiply(x[i : i + part.size], a, out=part)
        else:
            xp.copyto(part, x[i : i + part.size], casting="same_kind")
            part *= a
        mix_into(y[i : i + part.size], part)


@dataclass(frozen=True)
class Layout:
    """How a vector goes on the wire as the model holds it: ``buckets`` are (dtype, elements) of
    consecutive parts of the vector. A vector of one bucket in its own dtype is one frame, the
    vector itself."""

    buckets: tuple[tuple[np.dtype, int], ...]

    @classmethod
    def of(cls, vector: np.ndarray) -> Layout:
        """The vector sent as it is."""
        return cls(((vector.dtype, vector.size),))

    @property
    def nbytes(self) -> int:
        """The bytes a vector of this layout takes on the wire."""
        return sum(np.dtype(dtype).itemsize * size for dtype, size in self.buckets)

    def slice(self, lo: int, hi: int) -> Layout:
        """The layout of elements ``lo:hi`` of the vector (a local rank's slice)."""
        buckets, start = [], 0
        for dtype, size in self.buckets:
            overlap = min(hi, start + size) - max(lo, start)
            if overlap > 0:
                buckets.append((dtype, overlap))
            start += size
        return Layout(tuple(buckets) or ((self.buckets[0][0], 0),))

    def pack(self, vector: np.ndarray, copy: bool = False) -> list[np.ndarray]:
        """The frames of ``vector``: views where a bucket has the vector's dtype (copies with
        ``copy``, for frames that must not change while the vector does), else copies rounded
        to the bucket's dtype (exact for values read from the model)."""
        frames, start = [], 0
        for dtype, size in self.buckets:
            frames.append(vector[start : start + size].astype(dtype, copy=copy))
            start += size
        return frames

    def problem(self, frames: Frames) -> str | None:
        """Why ``frames`` are not a vector of this layout (a rejection reason), or None."""
        if len(frames) != len(self.buckets):
            return "tensor_count"
        for frame, (dtype, size) in zip(frames, self.buckets, strict=True):
            if frame.dtype != dtype or frame.shape != (size,):
                return "tensor_mismatch"
        return None

    def add_scaled(self, y: np.ndarray, frames: Frames, a: float, scratch: np.ndarray) -> None:
        """y += a * (the vector ``frames`` carry), widening each frame as it goes."""
        start = 0
        for frame in frames:
            add_scaled(y[start : start + frame.size], frame, a, scratch)
            start += frame.size

    def unpack(self, frames: Frames, dtype: np.dtype) -> np.ndarray:
        """The vector ``frames`` carry, in ``dtype`` (the frame itself when it is one already)."""
        if len(frames) == 1 and frames[0].dtype == dtype:
            return frames[0]
        vector = np.empty(sum(frame.size for frame in frames), dtype=dtype)
        start = 0
        for frame in frames:
            np.copyto(vector[start : start + frame.size], frame, casting="same_kind")
            start += frame.size
        return vector


class SendCopy:
    """The copy of a vector that a node's sends of one round go out from (they must not see
    the mixing that follows), made again in the same memory once no send holds it any longer:
    a node whose sends keep up holds one such copy, not one per round still in flight, and one
    whose sends lag gets a new copy while the old one is freed as they leave.

    Whether a send still holds the copy is whether anything but this object refers to its
    frames: ZeroMQ's zero-copy frames (until the kernel has taken the bytes), a stream's chunks
    waiting for credit, an in-memory network's message in a neighbour's inbox.
    """

    _OWN = 3  # references to a frame while it is checked: the list's, the loop's, the call's

    def __init__(self, layout: Layout) -> None:
        self._layout = layout
        self._frames: list[np.ndarray] | None = None

    @property
    def held(self) -> bool:
        """Whether a send still holds the last copy."""
        return self._frames is not None and any(sys.getrefcount(f) > self._OWN for f in self._frames)

    def pack(self, vector: np.ndarray) -> list[np.ndarray]:
        """``vector``'s frames (see :meth:`Layout.pack`), in the last copy's memory when it is free."""
        if self._frames is None or self.held:
            self._frames = self._layout.pack(vector, copy=True)
            return self._frames
        start = 0
        for frame in self._frames:
            np.copyto(frame, vector[start : start + frame.size], casting="unsafe")  # (as astype)
            start += frame.size
        return self._frames
