"""The wire format: one versioned msgpack header frame, then one raw frame per tensor.

A message on the wire is ``[header, tensor_0, tensor_1, ...]``. The header is a msgpack map::

    {"v": 1, "kind": "params", "sender": "node-3", "session": 81723, "seq": 12, "round": 40,
     "tensors": [{"dtype": "float32", "shape": [101770], "nbytes": 407080}], "meta": {...}}

Tensor frames are the arrays' own memory (little-endian, C order): :func:`encode` returns
buffers that alias the arrays and :func:`decode` returns arrays that alias the received frames,
so the payload is never copied by the codec. Decoding checks every field and limit before any
array is built and raises :class:`WireError` with a machine-readable ``reason``; nothing from
the network is ever unpickled.

A payload larger than one chunk goes as a stream of chunk messages (:func:`encode_chunks`):
each has the whole message's header plus ``"chunk": [index, count, offset]`` and, as frames,
the slices of the tensors' memory that make up bytes ``offset...`` of the concatenated payload.
``p2p.transport.reassembly`` reassembles them, or, for the kinds a reader takes piece by piece,
hands each chunk on as it comes (a message with its :class:`Piece`); no ZeroMQ message is ever
larger than :data:`MAX_CHUNK_BYTES`.
"""

from __future__ import annotations

import math
import re
import reprlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

import msgpack
import numpy as np

PROTOCOL_VERSION = 1

MAX_HEADER_BYTES = 64 * 1024
MAX_TENSORS = 64
MAX_NDIM = 8
MAX_META_ITEMS = 32
MAX_META_DEPTH = 6  # containers inside containers in a header's meta (membership needs 3)
MAX_NAME_CHARS = 128
CHUNK_BYTES = 4 << 20  # payloads above this go as a stream of chunks of this size
MAX_CHUNK_BYTES = 16 << 20  # the largest payload of one ZeroMQ message a node accepts
_U64 = 2**64 - 1

_KIND = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")
_HEADER_KEYS = frozenset({"v", "kind", "sender", "session", "seq", "round", "tensors", "meta", "chunk"})
_OPTIONAL_KEYS = frozenset({"meta", "chunk"})
_TENSOR_KEYS = frozenset({"dtype", "shape", "nbytes"})

#: dtypes a tensor frame may carry; anything else is rejected before an array is built.
WIRE_DTYPES = frozenset({
    "float16", "bfloat16", "float32", "float64",
    "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "bool",
})  # fmt: skip


@cache
def wire_dtype(name: str) -> np.dtype:
    """The little-endian numpy dtype of ``name``, one of :data:`WIRE_DTYPES`. bfloat16 is
    ml_dtypes' (the one JAX uses: a model's bf16 values in 2 bytes), imported only when a
    bfloat16 frame comes or goes: it takes a second, which a float32 node never pays."""
    if name == "bfloat16":
        import ml_dtypes

        bfloat16: np.dtype = np.dtype(ml_dtypes.bfloat16)
        return bfloat16
    return np.dtype(name).newbyteorder("<")


if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("gossipmesh's wire format needs a little-endian host")


class WireError(ValueError):
    """A received message that breaks the wire format; ``reason`` names the broken rule."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


TensorSpec = tuple[np.dtype, tuple[int, ...], int]  # dtype, shape, nbytes


@dataclass(frozen=True)
class Piece:
    """Where a chunk handed on by itself sits in its message: its ``tensors`` are bytes
    ``offset...`` (uint8 arrays, one after the other) of the concatenated payload of tensors
    ``specs``. The transport checked that it fits its stream (see ``p2p.transport.reassembly``)."""

    offset: int
    specs: tuple[TensorSpec, ...]

    @property
    def total(self) -> int:
        """The whole payload's bytes."""
        return sum(nbytes for _, _, nbytes in self.specs)


@dataclass(frozen=True)
class Message:
    """A decoded message. ``tensors`` are read-only arrays that alias the received frames; with
    a ``piece``, they are one chunk's bytes of the message's payload."""

    kind: str
    sender: str
    round: int
    tensors: Sequence[np.ndarray] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)
    session: int = 0
    seq: int = 0
    key: str = ""  # the CURVE public key (z85) the message came with; "" without CURVE
    piece: Piece | None = None


@dataclass(frozen=True)
class Chunk:
    """One piece of a message sent as a stream: the message without its tensors, the tensors'
    specs, and bytes ``offset...`` of their concatenated payload (``pieces``, in order)."""

    message: Message
    specs: tuple[TensorSpec, ...]
    index: int
    count: int
    offset: int
    pieces: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    @property
    def total(self) -> int:
        return sum(nbytes for _, _, nbytes in self.specs)


@dataclass(frozen=True)
class Limits:
    """Bounds a decoder enforces; the transport sets ``max_message_bytes`` from the model size."""

    max_message_bytes: int = 1 << 31
    max_tensors: int = MAX_TENSORS


def encode(
    *,
    kind: str,
    sender: str,
    round: int,
    tensors: Sequence[np.ndarray] = (),
    meta: Mapping[str, Any] | None = None,
    session: int = 0,
    seq: int = 0,
) -> list[Any]:
    """Frames for one message: the packed header, then each tensor's memory (not a copy).

    Tensors must be C-contiguous with a wire dtype; this is checked here because a silent copy
    would defeat the zero-copy path. The caller must not modify a tensor until it is sent.
    """
    header, views = _header_and_views(kind, sender, round, tensors, meta, session)
    return [msgpack.packb({**header, "seq": seq}, use_bin_type=True), *views]


def encode_chunks(
    *,
    kind: str,
    sender: str,
    round: int,
    tensors: Sequence[np.ndarray],
    meta: Mapping[str, Any] | None = None,
    session: int = 0,
    seqs: Iterator[int],
    chunk_bytes: int = CHUNK_BYTES,
) -> list[list[Any]]:
    """The messages of a stream: frames of each chunk of at most ``chunk_bytes`` payload bytes,
    slices of the tensors' own memory (no copy). Each chunk takes the next seq from ``seqs``."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    header, views = _header_and_views(kind, sender, round, tensors, meta, session)
    total = sum(v.nbytes for v in views)
    count = max(1, -(-total // chunk_bytes))
    messages = []
    for index in range(count):
        start, end = index * chunk_bytes, min((index + 1) * chunk_bytes, total)
        pieces, position = [], 0
        for view in views:
            lo, hi = max(start, position), min(end, position + view.nbytes)
            if lo < hi:
                pieces.append(view[lo - position : hi - position])
            position += view.nbytes
        chunk_header = {**header, "seq": next(seqs), "chunk": [index, count, start]}
        messages.append([msgpack.packb(chunk_header, use_bin_type=True), *pieces])
    return messages


def _header_and_views(
    kind: str,
    sender: str,
    round: int,
    tensors: Sequence[np.ndarray],
    meta: Mapping[str, Any] | None,
    session: int,
) -> tuple[dict[str, Any], list[memoryview]]:
    if not _KIND.match(kind):
        raise ValueError(f"message kind {kind!r} must match {_KIND.pattern}")
    descriptors = []
    views = []
    for array in tensors:
        dtype_name = _wire_dtype_name(array.dtype)
        if not array.flags.c_contiguous:
            raise ValueError("tensors must be C-contiguous; call np.ascontiguousarray first")
        descriptors.append({"dtype": dtype_name, "shape": list(array.shape), "nbytes": array.nbytes})
        views.append(array.reshape(-1).view(np.uint8).data)
    header: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "kind": kind,
        "sender": sender,
        "session": session,
        "round": round,
        "tensors": descriptors,
    }
    if meta:
        header["meta"] = dict(meta)
    return header, views


def decode(frames: Sequence[Any], limits: Limits = Limits()) -> Message | Chunk:
    """Validate and decode ``[header, *tensor_frames]`` (bytes, memoryviews or zmq.Frames):
    a whole message, or one chunk of a stream."""
    if not frames:
        raise WireError("frame_count", "empty message")
    header = _unpack_header(_buffer(frames[0]))
    descriptors = header["tensors"]
    if len(descriptors) > limits.max_tensors:
        raise WireError("too_large", f"{len(descriptors)} tensors > limit {limits.max_tensors}")
    specs = [_tensor_spec(d, limits.max_message_bytes) for d in descriptors]
    total = sum(nbytes for _, _, nbytes in specs)
    if total > limits.max_message_bytes:
        raise WireError("too_large", f"{total} payload bytes > limit {limits.max_message_bytes}")
    envelope = Message(
        kind=header["kind"],
        sender=header["sender"],
        round=header["round"],
        meta=header.get("meta", {}),
        session=header["session"],
        seq=header["seq"],
    )
    if "chunk" in header:
        return _chunk(envelope, tuple(specs), header["chunk"], [_buffer(f) for f in frames[1:]])
    payload = frames[1:]
    if len(descriptors) != len(payload):
        raise WireError(
            "frame_count", f"header describes {len(descriptors)} tensors, got {len(payload)} frames"
        )
    tensors = []
    for (dtype, shape, nbytes), frame in zip(specs, payload, strict=True):
        buffer = _buffer(frame)
        if buffer.nbytes != nbytes:
            raise WireError("size_mismatch", f"frame has {buffer.nbytes} bytes, header says {nbytes}")
        array = np.frombuffer(buffer, dtype=dtype) if nbytes else np.empty(0, dtype=dtype)
        array = array.reshape(shape)
        array.flags.writeable = False
        tensors.append(array)
    return replace(envelope, tensors=tuple(tensors))


def _chunk(envelope: Message, specs: tuple[TensorSpec, ...], place: Any, pieces: list[memoryview]) -> Chunk:
    if not (isinstance(place, list) and len(place) == 3 and all(_is_uint(v, _U64) for v in place)):
        raise WireError("header_schema", f"chunk must be [index, count, offset], got {shown(place)}")
    index, count, offset = place
    chunk = Chunk(envelope, specs, index, count, offset, tuple(pieces))
    if not index < count <= max(1, chunk.total) or offset + chunk.nbytes > chunk.total:
        raise WireError("chunk", f"chunk {index} of {count} at {offset} does not fit {chunk.total} bytes")
    if chunk.nbytes > MAX_CHUNK_BYTES or (chunk.nbytes == 0 and chunk.total > 0):
        raise WireError("chunk", f"a chunk carries {chunk.nbytes} bytes (1 to {MAX_CHUNK_BYTES})")
    return chunk


def _wire_dtype_name(dtype: np.dtype) -> str:
    if dtype.name not in WIRE_DTYPES or dtype.byteorder == ">":
        raise ValueError(f"dtype {dtype} cannot go on the wire; use one of {sorted(WIRE_DTYPES)}")
    return dtype.name


def _buffer(frame: Any) -> memoryview:
    """The bytes of a frame without copying (zmq.Frame exposes ``.buffer``)."""
    view = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _unpack_header(raw: memoryview) -> dict[str, Any]:
    if raw.nbytes > MAX_HEADER_BYTES:
        raise WireError("header_too_large", f"{raw.nbytes} bytes > {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_HEADER_BYTES,
            max_bin_len=0,
            max_array_len=MAX_TENSORS * MAX_NDIM,
            max_map_len=MAX_META_ITEMS + len(_HEADER_KEYS),
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types for garbage; all mean the same here
        raise WireError("header_not_msgpack", f"{type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(header, dict):
        raise WireError("header_schema", f"header is a {type(header).__name__}, not a map")
    keys = set(header)
    missing = _HEADER_KEYS - _OPTIONAL_KEYS - keys
    if missing or not keys <= _HEADER_KEYS:
        raise WireError(
            "header_schema", f"missing keys {sorted(missing)}, unknown keys {sorted(keys - _HEADER_KEYS)}"
        )
    if header["v"] != PROTOCOL_VERSION or type(header["v"]) is not int:
        raise WireError("version", f"protocol {shown(header['v'])}, this node speaks {PROTOCOL_VERSION}")
    kind, sender = header["kind"], header["sender"]
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise WireError("header_schema", f"bad kind {shown(kind)}")
    if not isinstance(sender, str) or not 0 < len(sender) <= MAX_NAME_CHARS:
        raise WireError("header_schema", f"bad sender {shown(sender)}")
    for key in ("session", "seq", "round"):
        if not _is_uint(header[key], _U64):
            raise WireError("header_schema", f"{key} must be an unsigned 64-bit int: {shown(header[key])}")
    if not isinstance(header["tensors"], list):
        raise WireError("header_schema", "tensors must be a list")
    meta = header.get("meta", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise WireError("header_schema", "meta must be a map with string keys")
    if _depth(meta) > MAX_META_DEPTH:
        raise WireError("header_schema", f"meta nests containers more than {MAX_META_DEPTH} deep")
    return header


def _depth(value: Any) -> int:
    """How deep containers nest in ``value`` (iteratively: a hostile depth must not recurse)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth <= MAX_META_DEPTH:
                children = item.values() if isinstance(item, dict) else item
                stack.extend((child, depth + 1) for child in children)
    return deepest


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxdict = 2, 40, 40, 4, 4


def shown(value: Any) -> str:
    """A short, bounded ``repr`` of a received value for error messages and logs."""
    return _SHOWN.repr(value)


def _tensor_spec(descriptor: Any, max_bytes: int) -> TensorSpec:
    if not isinstance(descriptor, dict) or set(descriptor) != _TENSOR_KEYS:
        raise WireError("header_schema", f"tensor descriptor must have keys {sorted(_TENSOR_KEYS)}")
    name = descriptor["dtype"]
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise WireError("dtype", f"dtype {shown(name)} is not one of {sorted(WIRE_DTYPES)}")
    dtype = wire_dtype(name)
    shape = descriptor["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_uint(d, _U64) for d in shape):
        raise WireError("shape", f"shape {shown(shape)} must be a list of at most {MAX_NDIM} sizes")
    # numpy refuses a shape whose non-zero sizes multiply past the address space, even with no
    # element: bound them as if every size were at least one
    if math.prod(max(d, 1) for d in shape) * dtype.itemsize > max_bytes:
        raise WireError("too_large", f"shape {shown(shape)} of {dtype.name} exceeds {max_bytes} bytes")
    nbytes = descriptor["nbytes"]
    if not _is_uint(nbytes, _U64):
        raise WireError("header_schema", f"nbytes {shown(nbytes)} must be an unsigned int")
    expected = dtype.itemsize
    for dim in shape:
        expected *= dim
    if expected != nbytes:
        raise WireError(
            "size_mismatch", f"shape {shape} of {dtype.name} is {expected} bytes, header says {nbytes}"
        )
    return dtype, tuple(shape), nbytes


def _is_uint(value: Any, bound: int) -> bool:
    return type(value) is int and 0 <= value <= bound
