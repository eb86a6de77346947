"""Codecs for model deltas: ``none``, ``fp16``, ``bf16``, ``int8``, ``topk:FRACTION``,
``randk:FRACTION`` (as in ``--compression``).

A codec turns a float32 vector into wire frames plus a small meta dict, and back. Decoding is a
pure function of (frames, meta, size), the same on every node, so a sender can apply to its own
public copy exactly what its receivers apply (CHOCO-SGD relies on that). Decoding checks every
frame against the vector size before building anything, and raises :class:`CodecError` with a
reason the node counts: frames come from the network.

Sparse codecs pick the cheaper of two formats per message: ``index`` (uint32 positions + float32
values, 8 bytes a kept value) or ``bitmap`` (one bit per element + float32 values), so a dense
selection never costs more than 1/8 of a byte per element for its positions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

INT8_BLOCK = 256  # elements sharing one int8 scale: 4 bytes of scale per 256 bytes of values
_FP16_MAX = float(np.finfo(np.float16).max)
_INDEX_BYTES = 4


class CodecError(ValueError):
    """A received compressed vector that does not decode; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Encoded:
    frames: list[np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.frames)


class Codec:
    """The identity codec (``none``): float32 as it is. Subclasses compress."""

    name = "none"
    #: whether decode(encode(x)) == x bit for bit
    exact = True

    def encode(self, x: np.ndarray) -> Encoded:
        return Encoded([np.ascontiguousarray(x, dtype=np.float32)])

    def decode(self, frames: Sequence[np.ndarray], meta: Mapping[str, Any], size: int) -> np.ndarray:
        (values,) = _expect(frames, [(np.float32, size)])
        return values

    def __str__(self) -> str:
        return self.name


class Float16(Codec):
    name = "fp16"
    exact = False

    def encode(self, x: np.ndarray) -> Encoded:
        # Clip first: a value beyond fp16's range would become inf, which receivers refuse.
        return Encoded([np.clip(x, -_FP16_MAX, _FP16_MAX).astype(np.float16)])

    def decode(self, frames: Sequence[np.ndarray], meta: Mapping[str, Any], size: int) -> np.ndarray:
        (values,) = _expect(frames, [(np.float16, size)])
        return values.astype(np.float32)


class BFloat16(Codec):
    """bfloat16 as the top 16 bits of float32, rounded to nearest even (numpy has no bf16)."""

    name = "bf16"
    exact = False

    def encode(self, x: np.ndarray) -> Encoded:
        bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
        top = (bits.astype(np.uint64) + rounding) >> np.uint64(16)
        # A finite value at the very top of the range rounds to inf: keep the largest finite.
        top = np.minimum(top & np.uint64(0x7FFF), np.uint64(0x7F7F)) | (top & np.uint64(0x8000))
        return Encoded([top.astype(np.uint16)])

    def decode(self, frames: Sequence[np.ndarray], meta: Mapping[str, Any], size: int) -> np.ndarray:
        (top,) = _expect(frames, [(np.uint16, size)])
        return (top.astype(np.uint32) << np.uint32(16)).view(np.float32)


class Int8(Codec):
    """Symmetric int8 with one float32 scale per block of INT8_BLOCK elements (max-abs / 127,
    round to nearest): about 3.9x fewer bytes than float32."""

    name = "int8"
    exact = False

    def encode(self, x: np.ndarray) -> Encoded:
        blocks = _blocks(np.ascontiguousarray(x, dtype=np.float32))
        scales = np.abs(blocks).max(axis=1) / 127.0
        safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
        q = np.rint(blocks / safe[:, None]).astype(np.int8).reshape(-1)[: x.size]
        return Encoded([q, scales.astype(np.float32)])

    def decode(self, frames: Sequence[np.ndarray], meta: Mapping[str, Any], size: int) -> np.ndarray:
        q, scales = _expect(frames, [(np.int8, size), (np.float32, _block_count(size))])
        _check_finite(scales)
        padded = np.zeros(_block_count(size) * INT8_BLOCK, dtype=np.float32)
        padded[:size] = q
        blocks = padded.reshape(-1, INT8_BLOCK)
        blocks *= scales[:, None]
        return padded[:size]


class Sparse(Codec):
    """Keeps ``fraction`` of the elements (at least one): the largest in magnitude (``topk``) or
    a uniformly random subset (``randk``, unscaled as CHOCO-SGD uses it)."""

    exact = False

    def __init__(self, name: str, fraction: float, seed: int | None = None) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"{name}: the fraction must be in (0, 1], got {fraction}")
        self.name = name
        self.fraction = fraction
        self._rng = np.random.default_rng(seed)

    def __str__(self) -> str:
        return f"{self.name}:{self.fraction:g}"

    def kept(self, size: int) -> int:
        return max(1, min(size, math.ceil(self.fraction * size)))

    def encode(self, x: np.ndarray) -> Encoded:
        k = self.kept(x.size)
        if self.name == "topk":
            chosen = np.argpartition(np.abs(x), x.size - k)[x.size - k :]
        else:
            chosen = self._rng.choice(x.size, size=k, replace=False)
        chosen.sort()
        values = np.ascontiguousarray(x[chosen], dtype=np.float32)
        if k * _INDEX_BYTES <= _bitmap_bytes(x.size):
            return Encoded([chosen.astype(np.uint32), values], {"sparse": "index"})
        mask = np.zeros(x.size, dtype=bool)
        mask[chosen] = True
        return Encoded([np.packbits(mask), values], {"sparse": "bitmap"})

    def decode(self, frames: Sequence[np.ndarray], meta: Mapping[str, Any], size: int) -> np.ndarray:
        form = meta.get("sparse")
        k = self.kept(size)
        out = np.zeros(size, dtype=np.float32)
        if form == "index":
            positions, values = _expect(frames, [(np.uint32, k), (np.float32, k)])
            if positions.size and (positions[-1] >= size or (np.diff(positions.astype(np.int64)) <= 0).any()):
                raise CodecError("codec_index", f"positions must be increasing and < {size}")
        elif form == "bitmap":
            bitmap, values = _expect(frames, [(np.uint8, _bitmap_bytes(size)), (np.float32, k)])
            mask = np.unpackbits(bitmap, count=size).astype(bool)
            if int(mask.sum()) != k or np.unpackbits(bitmap)[size:].any():
                raise CodecError("codec_index", f"the bitmap must mark exactly {k} of {size} elements")
            positions = np.flatnonzero(mask)
        else:
            raise CodecError("codec_format", f"unknown sparse format {form!r}")
        _check_finite(values)
        out[positions] = values
        return out


CODECS = ("none", "fp16", "bf16", "int8", "topk:FRACTION", "randk:FRACTION")


def parse_codec(spec: str, seed: int | None = None) -> Codec:
    """A codec from its ``--compression`` spelling; ValueError (listing the choices) if unknown."""
    name, _, arg = spec.strip().partition(":")
    simple: dict[str, type[Codec]] = {"none": Codec, "fp16": Float16, "bf16": BFloat16, "int8": Int8}
    if name in simple and not arg:
        return simple[name]()
    if name in ("topk", "randk"):
        try:
            fraction = float(arg)
        except ValueError:
            raise ValueError(f"{name} needs a fraction of elements to keep, e.g. {name}:0.01") from None
        return Sparse(name, fraction, seed)
    raise ValueError(f"unknown compression {spec!r}; choose one of: {', '.join(CODECS)}")


def _expect(frames: Sequence[np.ndarray], shapes: list[tuple[type, int]]) -> list[np.ndarray]:
    """Check the frames' count, dtypes and lengths (1-D) against what the codec sends."""
    if len(frames) != len(shapes):
        raise CodecError("codec_frames", f"{len(frames)} frames, expected {len(shapes)}")
    for frame, (dtype, length) in zip(frames, shapes, strict=True):
        if frame.dtype != dtype or frame.shape != (length,):
            raise CodecError(
                "codec_shape",
                f"a frame is {frame.dtype}{list(frame.shape)}, expected {np.dtype(dtype)}[{length}]",
            )
    return list(frames)


def _check_finite(values: np.ndarray) -> None:
    if not np.isfinite(values).all():
        raise CodecError("non_finite", "NaN or infinite values")


def _block_count(size: int) -> int:
    return -(-size // INT8_BLOCK)


def _blocks(x: np.ndarray) -> np.ndarray:
    padded = np.zeros(_block_count(x.size) * INT8_BLOCK, dtype=np.float32)
    padded[: x.size] = x
    return padded.reshape(-1, INT8_BLOCK)


def _bitmap_bytes(size: int) -> int:
    return -(-size // 8)
