"""Codecs for model deltas: ``none``, ``fp16``, ``bf16``, ``int8``, ``topk:FRACTION``,
``randk:FRACTION`` (``Codec.parse``), and ``auto``: one of :data:`AUTO_LADDER` per
epoch of rounds, as the mesh agreed from what its links cost (``gossip.tuning.auto_codec``).

A codec turns a float32 vector into wire frames plus a small meta dict, and back. Decoding is a
pure function of (frames, meta, size), the same on every node, so a sender can apply to its own
public copy exactly what its receivers apply (CHOCO-SGD relies on that). A message names the
codec it was encoded with (``meta["codec"]``): a receiver decodes only what its own
configuration allows (:meth:`Codec.for_message`), so a neighbour configured with another codec
is counted (``codec_mismatch``), not misread. Decoding checks every
frame against the vector size before building anything, and what it decodes is finite (int8's
scales are bounded so that no decoded value overflows), or it raises :class:`CodecError` with a
reason the node counts: frames come from the network.

Sparse codecs pick the cheaper of two formats for their positions per message: ``segments``
(the vector cut into segments of 2^16 elements: a uint32 count per segment and a uint16 offset
per kept value, 2 bytes a kept value) or ``bitmap`` (one bit per element), so a dense selection
never costs more than 1/8 of a byte per element for its positions. The kept values go as int8
with a scale per INT8_BLOCK of them (``values=int8``, the default: 3 bytes a kept value, the
rounding left to CHOCO's error feedback like what top-k drops) or as float32 (``values=float32``).
Every ``dense_every``-th round (default 20; rounds M-1, 2M-1, ...; 0: never) sends the whole
difference as ``int8`` instead: what the sparse rounds left owed goes out at once, and CHOCO
mixes that round at the dense codecs' step size. Measured on the digits MLP (8 nodes,
exponential, 20 ms steps), top-1% with float32 values and no dense round put every node at 0.95
with 13.8x fewer bytes than D-PSGD but ended 1.4 points lower (0.953 against 0.967); with int8
values and a dense round every 20 (about 0.08 bytes an element a round against float32's 4),
24.1x fewer and 0.6 points lower (0.961).

Every codec runs on the array module of its input (``gossip.buffers.arrays``): numpy on the CPU, cupy
kernels for a vector on a CUDA device, the same lines computing the same function. Only
``randk`` draws on the host, with numpy's generator on both paths, so a seed picks the same
positions wherever the vector lives.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from gossip.buffers.arrays import Array, array_module, to_device
from gossip.buffers.vector import block_size
from topologies.spec import Params, choice, number, parse_spec, spellings

INT8_BLOCK = 256  # elements sharing one int8 scale: 4 bytes of scale per 256 bytes of values
_FP16_MAX = float(np.finfo(np.float16).max)
_INT8_MAX_SCALE = float(np.finfo(np.float32).max) / 127  # the largest an encoder makes
SEGMENT = 1 << 16  # elements per segment of the sparse ``segments`` format (uint16 offsets)


class CodecError(ValueError):
    """A received compressed vector that does not decode; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Encoded:
    frames: list[Array]  # arrays of the input's module: to_host() makes them sendable
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.frames)


class Codec:
    """The identity codec (``none``): float32 as it is. Subclasses compress.

    A codec encodes whole vectors, and decodes in two steps: :meth:`check` refuses frames that
    are not a vector it makes (without building the vector), :meth:`add_decoded` adds the
    decoded vector to another. The dense codecs work chunk by chunk: neither step, nor
    encoding the difference of two vectors, makes a temporary the size of the model."""

    name = "none"
    #: whether decode(encode(x)) == x bit for bit
    exact = True
    #: whether a message carries every element (then it decodes as it arrives: :class:`StreamedDecode`)
    dense = True

    def encode(self, x: Array, minus: Array | None = None) -> Encoded:
        """Q(x), or Q(x - minus)."""
        xp = array_module(x)
        if minus is None:
            return Encoded([xp.ascontiguousarray(x, dtype=np.float32)])
        return Encoded([xp.subtract(x, minus, dtype=np.float32)])

    def check(self, frames: Sequence[Array], meta: Mapping[str, Any], size: int) -> None:
        """Raise :class:`CodecError` unless ``frames`` and ``meta`` encode ``size`` finite values."""
        *side, values = _expect(frames, self.stream_frames(size))
        self.check_side(side)
        for lo, hi in _spans(values):
            self.check_values(values[lo:hi])

    def add_decoded(
        self, y: Array, frames: Sequence[Array], meta: Mapping[str, Any], scale: float = 1.0
    ) -> None:
        """y += ``scale`` x the vector that ``frames`` (checked) encode."""
        *side, values = frames
        for lo, hi in _spans(y):
            y[lo:hi] += self.decode_range(values[lo:hi], lo, side, scale)

    # A dense codec is these three (and its encoder): check and add_decoded above, and
    # StreamedDecode as a message arrives, are made of them.

    def stream_frames(self, size: int) -> list[tuple[np.dtype, int]]:
        """(dtype, elements) of each frame of a vector of ``size``, in order, for a dense codec:
        every frame but the last is side information (int8's scales), the last the values."""
        return [(np.dtype(np.float32), size)]

    def check_side(self, side: Sequence[Array]) -> None:
        """Raise :class:`CodecError` unless the frames before the values are ones it makes."""

    def check_values(self, values: Array) -> None:
        """Raise :class:`CodecError` for a part of the values' frame no encoder makes."""
        _check_finite(values)

    def decode_range(self, values: Array, first: int, side: Sequence[Array], scale: float = 1.0) -> Array:
        """``scale`` x elements ``first...`` of the vector as float32, from their ``values`` (a
        part of the last frame, checked) and the checked ``side`` frames."""
        return values if scale == 1.0 else values * np.float32(scale)

    def decode(self, frames: Sequence[Array], meta: Mapping[str, Any], size: int) -> Array:
        """The vector ``frames`` encode (checked first)."""
        self.check(frames, meta, size)
        out = array_module(frames[0]).zeros(size, dtype=np.float32)
        self.add_decoded(out, frames, meta)
        return out

    def for_round(self, round: int) -> Codec:
        """The codec that encodes round ``round``'s update (``auto`` picks one per epoch)."""
        return self

    def for_message(self, meta: Mapping[str, Any]) -> Codec:
        """The codec that decodes a message with ``meta``: this one, if the sender named it."""
        if meta.get("codec") != str(self):
            raise CodecError("codec_mismatch", f"encoded with {meta.get('codec')!r}; this node runs {self}")
        return self

    @staticmethod
    def parse(spec: str, seed: int | None = None) -> Codec:
        """A codec from its spelling (``int8``, ``topk:0.01``...); raises
        ``topologies.SpecError`` listing the choices. ``seed`` seeds random-k's draws."""
        name, params = parse_spec(spec, _CHOICES, "codec")
        if name == AutoCodec.name:
            return AutoCodec()
        if name in _SIMPLE:
            return _SIMPLE[name]()
        return Sparse(name, params.pop("fraction"), seed, **params)

    def __str__(self) -> str:
        return self.name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))


class Float16(Codec):
    name = "fp16"
    exact = False

    def encode(self, x: Array, minus: Array | None = None) -> Encoded:
        out = array_module(x).empty(x.size, dtype=np.float16)
        for lo, hi, part in _chunks_of(x, minus):
            # Clip first: a value beyond fp16's range would become inf, which receivers refuse.
            out[lo:hi] = part.clip(-_FP16_MAX, _FP16_MAX)
        return Encoded([out])

    def stream_frames(self, size: int) -> list[tuple[np.dtype, int]]:
        return [(np.dtype(np.float16), size)]

    def decode_range(self, values: Array, first: int, side: Sequence[Array], scale: float = 1.0) -> Array:
        return _scaled(values.astype(np.float32), scale)  # (every float16 widens exactly)


class BFloat16(Codec):
    """bfloat16 as the top 16 bits of float32, rounded to nearest even (numpy has no bf16)."""

    name = "bf16"
    exact = False

    def encode(self, x: Array, minus: Array | None = None) -> Encoded:
        xp = array_module(x)
        out = xp.empty(x.size, dtype=np.uint16)
        for lo, hi, part in _chunks_of(x, minus):
            bits = part.view(np.uint32)
            rounding = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
            top = (bits.astype(np.uint64) + rounding) >> np.uint64(16)
            # A finite value at the very top of the range rounds to inf: keep the largest finite.
            out[lo:hi] = xp.minimum(top & np.uint64(0x7FFF), np.uint64(0x7F7F)) | (top & np.uint64(0x8000))
        return Encoded([out])

    def stream_frames(self, size: int) -> list[tuple[np.dtype, int]]:
        return [(np.dtype(np.uint16), size)]

    def check_values(self, values: Array) -> None:
        if bool(((values & np.uint16(0x7F80)) == np.uint16(0x7F80)).any()):  # all exponent bits set
            raise CodecError("non_finite", "NaN or infinite values")

    def decode_range(self, values: Array, first: int, side: Sequence[Array], scale: float = 1.0) -> Array:
        return _scaled((values.astype(np.uint32) << np.uint32(16)).view(np.float32), scale)


class Int8(Codec):
    """Symmetric int8 with one float32 scale per block of INT8_BLOCK elements (max-abs / 127,
    round to nearest): about 3.9x fewer bytes than float32. No encoder makes -128 or a scale
    above FLT_MAX / 127, so a checked vector decodes to finite values without being built."""

    name = "int8"
    exact = False

    def encode(self, x: Array, minus: Array | None = None) -> Encoded:
        xp = array_module(x)
        q = xp.empty(x.size, dtype=np.int8)
        scales = xp.empty(_block_count(x.size), dtype=np.float32)
        for lo, hi, part in _chunks_of(x, minus):
            # (a difference is a chunk of its own, scaled in place; a chunk of x is a view of it)
            whole = minus is not None and part.size % INT8_BLOCK == 0
            blocks = (part if whole else _padded(part)).reshape(-1, INT8_BLOCK)
            block_scales = _max_magnitudes(blocks)
            block_scales /= np.float32(127.0)
            with np.errstate(invalid="ignore"):  # (a block with a NaN or inf: check refuses it)
                blocks /= xp.where(block_scales > 0, block_scales, np.float32(1.0))[:, None]
                q[lo:hi] = xp.rint(blocks, out=blocks).reshape(-1)[: hi - lo]
            scales[lo // INT8_BLOCK : lo // INT8_BLOCK + block_scales.size] = block_scales
        return Encoded([scales, q])  # (the scales first: a receiver decodes q as it arrives)

    def stream_frames(self, size: int) -> list[tuple[np.dtype, int]]:
        return [(np.dtype(np.float32), _block_count(size)), (np.dtype(np.int8), size)]

    def check_side(self, side: Sequence[Array]) -> None:
        (scales,) = side
        _check_finite(scales)
        if not bool((array_module(scales).abs(scales) <= _INT8_MAX_SCALE).all()):
            raise CodecError(
                "codec_scale", f"an int8 scale above {_INT8_MAX_SCALE:.3g}: no encoder makes one"
            )

    def check_values(self, values: Array) -> None:
        if values.size and int(values.min()) == -128:  # (at the largest scales it decodes to -inf)
            raise CodecError("codec_value", "an int8 value of -128: no encoder makes one")

    def decode_range(self, values: Array, first: int, side: Sequence[Array], scale: float = 1.0) -> Array:
        (scales,) = side
        head = first % INT8_BLOCK  # (the range may begin and end inside a block)
        covering = scales[first // INT8_BLOCK : (first + values.size - 1) // INT8_BLOCK + 1]
        decoded = array_module(values).repeat(covering * np.float32(scale), INT8_BLOCK)[
            head : head + values.size
        ]
        decoded *= values  # (as add_decoded: each value times its block's scale x scale)
        return decoded


class Sparse(Codec):
    """Keeps ``fraction`` of the elements (at least one): the largest in magnitude (``topk``) or
    a uniformly random subset (``randk``, unscaled as CHOCO-SGD uses it); their values as float32
    or int8 (``values``); every ``dense_every``-th round all of them as int8 (0: never)."""

    DEFAULTS: ClassVar[dict[str, Any]] = {"values": "int8", "dense_every": 20}

    exact = False
    dense = False

    def __init__(
        self,
        name: str,
        fraction: float,
        seed: int | None = None,
        values: str = DEFAULTS["values"],
        dense_every: int = DEFAULTS["dense_every"],
    ) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"{name}: the fraction must be in (0, 1], got {fraction}")
        if dense_every < 0:
            raise ValueError(f"{name}: dense_every must be 0 (never) or more, got {dense_every}")
        self.name = name
        self.fraction = fraction
        self._values_name = values
        self.values: Codec = _VALUE_CODECS[values]()
        self.dense_every = dense_every
        self._rng = np.random.default_rng(seed)

    def __str__(self) -> str:
        chosen = {"values": self._values_name, "dense_every": self.dense_every}
        changed = [f",{key}={value}" for key, value in chosen.items() if value != self.DEFAULTS[key]]
        return f"{self.name}:{self.fraction:g}" + "".join(changed)

    def for_round(self, round: int) -> Codec:
        dense = self.dense_every and round % self.dense_every == self.dense_every - 1
        return _DENSE if dense else self

    def for_message(self, meta: Mapping[str, Any]) -> Codec:
        if self.dense_every and meta.get("codec") == str(_DENSE):
            return _DENSE
        return super().for_message(meta)

    def kept(self, size: int) -> int:
        return max(1, min(size, math.ceil(self.fraction * size)))

    def encode(self, x: Array, minus: Array | None = None) -> Encoded:
        xp = array_module(x)
        x = x if minus is None else xp.subtract(x, minus, dtype=np.float32)
        k = self.kept(x.size)
        if self.name == "topk":
            chosen = xp.argpartition(xp.abs(x), x.size - k)[x.size - k :]
        else:
            chosen = xp.asarray(self._rng.choice(x.size, size=k, replace=False))
        chosen.sort()
        values = self.values.encode(xp.ascontiguousarray(x[chosen], dtype=np.float32)).frames
        if 2 * k + 4 * _segment_count(x.size) <= _bitmap_bytes(x.size):
            counts = xp.bincount(chosen // SEGMENT, minlength=_segment_count(x.size)).astype(np.uint32)
            offsets = (chosen & (SEGMENT - 1)).astype(np.uint16)
            return Encoded([counts, offsets, *values], {"sparse": "segments"})
        mask = xp.zeros(x.size, dtype=bool)
        mask[chosen] = True
        return Encoded([xp.packbits(mask), *values], {"sparse": "bitmap"})

    def check(self, frames: Sequence[Array], meta: Mapping[str, Any], size: int) -> None:
        self.entries(frames, meta, size)

    def add_decoded(
        self, y: Array, frames: Sequence[Array], meta: Mapping[str, Any], scale: float = 1.0
    ) -> None:
        positions, values = self.entries(frames, meta, y.size)
        y[positions] += values if scale == 1.0 else values * np.float32(scale)  # (positions are distinct)

    def entries(self, frames: Sequence[Array], meta: Mapping[str, Any], size: int) -> tuple[Array, Array]:
        """The positions and values ``frames`` carry (checked; raises :class:`CodecError`)."""
        form = meta.get("sparse")
        k = self.kept(size)
        split = 2 if form == "segments" else 1  # the frames of the positions, then of the values
        if form == "segments":
            counts, offsets = _expect(frames[:split], [(np.uint32, _segment_count(size)), (np.uint16, k)])
            positions = _segment_positions(counts, offsets, size)
        elif form == "bitmap":
            (bitmap,) = _expect(frames[:split], [(np.uint8, _bitmap_bytes(size))])
            xp = array_module(bitmap)
            bits = xp.unpackbits(bitmap)  # all of them (cupy's has no count=): padding must be 0
            mask = bits[:size].astype(bool)
            if int(mask.sum()) != k or bits[size:].any():
                raise CodecError("codec_index", f"the bitmap must mark exactly {k} of {size} elements")
            positions = xp.flatnonzero(mask)
        else:
            raise CodecError("codec_format", f"unknown sparse format {form!r}")
        return positions, self.values.decode(frames[split:], {}, k)


def _segment_positions(counts: Array, offsets: Array, size: int) -> Array:
    """The positions a ``segments`` frame pair marks; they must be increasing and < ``size``."""
    xp = array_module(offsets)
    counts = counts.astype(np.int64)
    if int(counts.sum()) != offsets.size:
        raise CodecError("codec_index", f"the segment counts must add up to the {offsets.size} values")
    ends = xp.cumsum(counts)
    segment = xp.searchsorted(ends, xp.arange(offsets.size), side="right")
    positions = segment * SEGMENT + offsets.astype(np.int64)
    if positions.size and (int(positions[-1]) >= size or bool((positions[1:] <= positions[:-1]).any())):
        raise CodecError("codec_index", f"positions must be increasing and < {size}")
    return positions


_DENSE = Int8()  # what a sparse codec's dense rounds send
AUTO_LADDER: tuple[Codec, ...] = (Codec(), BFloat16(), Int8())  # least to most compressed


class AutoCodec(Codec):
    """``auto``: the rung of :data:`AUTO_LADDER` the mesh agreed on for each epoch of rounds.
    Dense codecs only: they keep CHOCO's step size at 1 and its convergence that of D-PSGD;
    a sparse codec changes how the mesh converges, which no link measurement can judge.

    ``level_for`` (round -> rung) is the node's agreement (``gossip.tuning.auto_codec``); the optimizer
    binds it. Each message is encoded by :meth:`for_round`'s codec and names it."""

    name = "auto"
    exact = False

    def __init__(self, level_for: Callable[[int], int] | None = None) -> None:
        self._level_for = level_for

    def bound(self, level_for: Callable[[int], int]) -> AutoCodec:
        """This codec choosing its rung by ``level_for``."""
        return AutoCodec(level_for)

    def for_round(self, round: int) -> Codec:
        if self._level_for is None:
            raise ValueError(
                "compression=auto is chosen by the mesh each epoch: use it through GossipOptimizer"
            )
        return AUTO_LADDER[self._level_for(round)]

    def for_message(self, meta: Mapping[str, Any]) -> Codec:
        for codec in AUTO_LADDER:
            if meta.get("codec") == codec.name:
                return codec
        raise CodecError("codec_mismatch", f"encoded with {meta.get('codec')!r}; auto takes {_AUTO_NAMES}")

    def encode(self, x: Array, minus: Array | None = None) -> Encoded:
        raise TypeError("auto encodes with the codec of a round: codec.for_round(round).encode(x)")

    def check(self, frames: Sequence[Array], meta: Mapping[str, Any], size: int) -> None:
        self.for_message(meta).check(frames, meta, size)

    def add_decoded(
        self, y: Array, frames: Sequence[Array], meta: Mapping[str, Any], scale: float = 1.0
    ) -> None:
        self.for_message(meta).add_decoded(y, frames, meta, scale)


_AUTO_NAMES = ", ".join(codec.name for codec in AUTO_LADDER)
_VALUE_CODECS: dict[str, type[Codec]] = {"float32": Codec, "int8": Int8}
_FRACTION = Params(
    {
        "fraction": number(float, above=0, at_most=1),
        "values": choice(_VALUE_CODECS),
        "dense_every": number(int, at_least=0),
    },
    positional="fraction",
    required=("fraction",),
)
_SIMPLE: dict[str, type[Codec]] = {"none": Codec, "fp16": Float16, "bf16": BFloat16, "int8": Int8}
_CHOICES = {**dict.fromkeys([*_SIMPLE, AutoCodec.name], Params()), "topk": _FRACTION, "randk": _FRACTION}
CODECS = tuple(spellings(_CHOICES))


def _expect(frames: Sequence[Array], shapes: Sequence[tuple[type | np.dtype, int]]) -> list[Array]:
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


def _scaled(decoded: Array, scale: float) -> Array:
    """``decoded`` (a temporary of its own) times ``scale``, in place."""
    if scale != 1.0:
        decoded *= np.float32(scale)
    return decoded


def _check_finite(values: Array) -> None:
    """Raise unless no value is NaN or infinite (chunk by chunk: no temporary of their size)."""
    xp = array_module(values)
    for lo, hi in _spans(values):
        if not bool(xp.isfinite(values[lo:hi]).all()):
            raise CodecError("non_finite", "NaN or infinite values")


def _max_magnitudes(blocks: Array) -> Array:
    """Each row's largest |value| of float32 ``blocks`` (NaN where the row holds one), reduced
    as integers: clearing the sign bit leaves an IEEE float's magnitude in an order its bits
    share, and integer row reductions vectorise where float ones do not (4x faster than a float
    max and min, the same bits)."""
    magnitudes = array_module(blocks).bitwise_and(blocks.view(np.int32), np.int32(0x7FFFFFFF))
    return magnitudes.max(axis=1).view(np.float32)


def _block_count(size: int) -> int:
    return -(-size // INT8_BLOCK)


def _padded(x: Array) -> Array:
    """``x`` as float32, zero-padded to whole INT8_BLOCKs."""
    padded = array_module(x).zeros(_block_count(x.size) * INT8_BLOCK, dtype=np.float32)
    padded[: x.size] = x
    return padded


def _spans(x: Array) -> Iterator[tuple[int, int]]:
    """(lo, hi) of each span of ``x`` a codec works on at a time (``block_size``: its
    temporaries stay in cache), a whole number of INT8_BLOCKs but the last."""
    step = block_size(x)
    for lo in range(0, x.size, step):
        yield lo, min(x.size, lo + step)


def _chunks_of(x: Array, minus: Array | None) -> Iterator[tuple[int, int, Array]]:
    """Each chunk of x (or of x - minus) as float32: (lo, hi, values). Read only: a chunk of a
    float32 x is a view of it."""
    xp = array_module(x)
    for lo, hi in _spans(x):
        if minus is None:
            yield lo, hi, x[lo:hi].astype(np.float32, copy=False)
        else:
            yield lo, hi, xp.subtract(x[lo:hi], minus[lo:hi], dtype=np.float32)


def _segment_count(size: int) -> int:
    return -(-size // SEGMENT)


def _bitmap_bytes(size: int) -> int:
    return -(-size // 8)


class StreamedDecode:
    """Adds ``scale`` x the vector a dense codec's message encodes into ``y`` as the message's
    payload arrives, in order, as bytes (:meth:`feed`, the pieces of ``PeerNetwork.take_pieces``):
    the frames before the values (int8's scales, 1/64 of its bytes) are kept until whole and
    checked, the values are checked and decoded a span (``block_size``) at a time and added where they
    belong. Nothing the size of the vector is held. Raises :class:`CodecError` for frames that
    are not the codec's (``codec_frames``), bytes out of order or across an element
    (``piece_order``), values no encoder makes, and a sum that overflowed (``non_finite``); the
    ranges fed before it stay added."""

    def __init__(self, codec: Codec, specs: Sequence[tuple[Any, Any, int]], y: Array, scale: float) -> None:
        self._codec = codec
        self._frames = codec.stream_frames(y.size)
        got = [(np.dtype(dtype), math.prod(shape)) for dtype, shape, _ in specs]
        if got != self._frames:
            raise CodecError("codec_frames", f"frames {got}, expected {self._frames} for {codec}")
        self._ends = list(itertools.accumulate(n * dtype.itemsize for dtype, n in self._frames))
        self._side_host = [np.empty(n, dtype) for dtype, n in self._frames[:-1]]
        self._side: list[Array] = []
        self._y = y
        self._scale = scale
        self.received = 0  # payload bytes fed so far

    @property
    def complete(self) -> bool:
        return self.received == self._ends[-1]

    def feed(self, data: np.ndarray, offset: int) -> None:
        """Payload bytes ``offset...`` (uint8), the next ones after those fed."""
        if offset != self.received or data.dtype != np.uint8 or offset + data.size > self._ends[-1]:
            raise CodecError("piece_order", f"bytes {offset}+{data.size}, expected from {self.received}")
        end = offset + data.size
        while self.received < end:
            frame = bisect.bisect_right(self._ends, self.received)
            dtype = self._frames[frame][0]
            start = self._ends[frame - 1] if frame else 0
            stop = min(end, self._ends[frame])
            if (self.received - start) % dtype.itemsize or (stop - start) % dtype.itemsize:
                raise CodecError("piece_order", "a piece ends inside an element")
            values = data[self.received - offset : stop - offset].view(dtype)
            first = (self.received - start) // dtype.itemsize
            if frame < len(self._side_host):
                self._side_host[frame][first : first + values.size] = values
                if stop == self._ends[frame] and frame == len(self._side_host) - 1:
                    self._side = to_device(self._side_host, self._y)
                    self._codec.check_side(self._side)
            else:
                self._add(values, first)
            self.received = stop

    def _add(self, values: np.ndarray, first: int) -> None:
        xp = array_module(self._y)
        step = block_size(self._y)  # (a span stays in cache through the passes)
        for lo in range(0, values.size, step):
            (part,) = to_device([values[lo : lo + step]], self._y)
            at = first + lo
            target = self._y[at : at + part.size]
            with np.errstate(over="ignore"):  # an overflow is what the check below catches
                self._codec.check_values(part)
                target += self._codec.decode_range(part, at, self._side, self._scale)
            if not bool(xp.isfinite(target).all()):
                raise CodecError("non_finite", "the sum overflowed")
