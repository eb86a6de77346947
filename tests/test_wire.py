"""The wire format: round trips, zero-copy, and every rejection path."""

from __future__ import annotations

import contextlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_fuzz import hostile_messages

from p2p.wire import (
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    WIRE_DTYPES,
    Limits,
    WireError,
    decode,
    encode,
    wire_dtype,
)


def _frames(**overrides: object) -> list[object]:
    tensors = overrides.pop("tensors", [np.arange(6, dtype=np.float32).reshape(2, 3)])
    return encode(kind="params", sender="node-1", round=7, tensors=tensors, **overrides)  # type: ignore[arg-type]


def _with_header(header_changes: dict[str, object], frames: list[object] | None = None) -> list[object]:
    frames = frames or _frames()
    header = msgpack.unpackb(frames[0])
    header.update(header_changes)
    return [msgpack.packb(header), *frames[1:]]


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES))
def test_round_trip_every_dtype(dtype: str) -> None:
    array = (np.arange(24) % 2).astype(wire_dtype(dtype)).reshape(2, 3, 4)
    message = decode(encode(kind="params", sender="a", round=3, tensors=[array], session=9, seq=4))
    assert message.kind == "params" and message.sender == "a" and message.round == 3
    assert (message.session, message.seq) == (9, 4)
    assert message.tensors[0].dtype == array.dtype and message.tensors[0].shape == (2, 3, 4)
    np.testing.assert_array_equal(message.tensors[0], array)


def test_round_trip_several_tensors_scalars_and_empty_with_meta() -> None:
    tensors = [np.float64(2.5) * np.ones(()), np.empty((0, 4), np.int32), np.arange(5, dtype=np.int64)]
    message = decode(encode(kind="hello", sender="n", round=0, tensors=tensors, meta={"knows": ["x"]}))
    assert [t.shape for t in message.tensors] == [(), (0, 4), (5,)]
    assert float(message.tensors[0]) == 2.5
    assert message.meta == {"knows": ["x"]}


def test_payload_is_never_copied() -> None:
    array = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)
    frames = encode(kind="params", sender="a", round=0, tensors=[array])
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.uint8), array)
    received = [bytes(frames[0]), bytearray(frames[1])]  # as if it came off a socket
    decoded = decode(received).tensors[0]
    assert np.shares_memory(decoded, np.frombuffer(received[1], dtype=np.uint8))
    assert not decoded.flags.writeable


def test_encode_refuses_what_would_need_a_copy() -> None:
    with pytest.raises(ValueError, match="C-contiguous"):
        encode(kind="params", sender="a", round=0, tensors=[np.ones((4, 4))[:, ::2]])
    with pytest.raises(ValueError, match="cannot go on the wire"):
        encode(kind="params", sender="a", round=0, tensors=[np.ones(3, dtype=">f4")])
    with pytest.raises(ValueError, match="kind"):
        encode(kind="Bad Kind", sender="a", round=0)


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([], "frame_count"),
        ([b"\xc1"], "header_not_msgpack"),
        ([msgpack.packb([1, 2])], "header_schema"),
        ([b"\x00" * (MAX_HEADER_BYTES + 1)], "header_too_large"),
        (_with_header({"v": PROTOCOL_VERSION + 1}), "version"),
        (_with_header({"v": True}), "version"),
        (_with_header({"kind": "NOT-A-KIND"}), "header_schema"),
        (_with_header({"sender": ""}), "header_schema"),
        (_with_header({"sender": 5}), "header_schema"),
        (_with_header({"round": -1}), "header_schema"),
        (_with_header({"seq": "5"}), "header_schema"),
        (_with_header({"session": 1.5}), "header_schema"),
        (_with_header({"tensors": "x"}), "header_schema"),
        (_with_header({"meta": [1]}), "header_schema"),
        (_with_header({"extra": 1}), "header_schema"),
        (_with_header({"tensors": [{"dtype": "object", "shape": [6], "nbytes": 48}]}), "dtype"),
        (_with_header({"tensors": [{"dtype": "float32", "shape": [6]}]}), "header_schema"),
        (_with_header({"tensors": [{"dtype": "float32", "shape": [-6], "nbytes": 24}]}), "shape"),
        (_with_header({"tensors": [{"dtype": "float32", "shape": [1] * 9, "nbytes": 4}]}), "shape"),
        (_with_header({"tensors": [{"dtype": "float32", "shape": [7], "nbytes": 24}]}), "size_mismatch"),
        (_with_header({"tensors": [{"dtype": "float32", "shape": [7], "nbytes": 28}]}), "size_mismatch"),
        (_with_header({"tensors": []}), "frame_count"),
        (_frames()[:1], "frame_count"),
        ([_frames()[0], b"\x00" * 23], "size_mismatch"),
    ],
)
def test_every_rejection_names_its_reason(frames: list[object], reason: str) -> None:
    with pytest.raises(WireError) as caught:
        decode(frames)
    assert caught.value.reason == reason


def test_size_limits_are_enforced_before_arrays_are_built() -> None:
    frames = _frames(tensors=[np.zeros(100, np.float32)])
    with pytest.raises(WireError) as caught:
        decode(frames, Limits(max_message_bytes=399))
    assert caught.value.reason == "too_large"
    assert decode(frames, Limits(max_message_bytes=400)).tensors[0].size == 100
    many = _frames(tensors=[np.zeros(1, np.float32)] * 3)
    with pytest.raises(WireError, match="3 tensors"):
        decode(many, Limits(max_tensors=2))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=4))
def test_garbage_raises_wire_error_or_decodes(frames: list[bytes]) -> None:
    with contextlib.suppress(WireError):
        decode(frames)


_INTS = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["v", "kind", "sender", "session", "seq", "round", "tensors", "meta", "x"]),
        st.one_of(_INTS, st.text(max_size=8), st.none(), st.lists(_INTS, max_size=3)),
    ),
    st.lists(st.binary(max_size=16), max_size=3),
)
def test_garbage_headers_raise_wire_error(header: dict[str, object], payload: list[bytes]) -> None:
    with contextlib.suppress(WireError):
        decode([msgpack.packb(header), *payload])


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 2**32))
def test_mutated_messages_raise_wire_error_or_decode(seed: int) -> None:
    frames = next(hostile_messages(seed, "fuzzer"))
    with contextlib.suppress(WireError):
        message = decode(frames, Limits(max_message_bytes=1 << 20))
        assert all(t.nbytes <= 1 << 20 for t in message.tensors)
