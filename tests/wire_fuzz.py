"""Hostile messages for fuzzing the decoder: valid messages, mutated (bit flips, truncation,
splices, wrong frame counts, hostile header values) or plain random bytes. Used by the live fuzz
test and by ``bench/fuzz_wire.py`` (the long run)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import msgpack
import numpy as np

from p2p.wire import Limits, WireError, decode, encode

_HOSTILE_VALUES: list[object] = [
    -1, 2**64 - 1, -(2**63), 1.5, float("nan"), "", "x" * 200, None, True, [], {}, [1] * 9, {"a": 1}, b"\x00",
]  # fmt: skip


def valid_message(rng: random.Random, sender: str) -> list[bytes]:
    dtype = rng.choice(["float32", "float64", "int64", "uint8", "float16"])
    shape = [rng.randrange(0, 5) for _ in range(rng.randrange(0, 4))]
    tensors = [np.zeros(shape, dtype=dtype) for _ in range(rng.randrange(0, 3))]
    frames = encode(
        kind=rng.choice(["params", "push", "ping", "sync", "state_chunk"]),
        sender=sender,
        round=rng.randrange(0, 1000),
        tensors=tensors,
        meta={"updates": [], "probe": rng.randrange(10)} if rng.random() < 0.5 else None,
        seq=rng.randrange(1, 1 << 20),
    )
    return [bytes(f) for f in frames]


def mutate(frames: list[bytes], rng: random.Random) -> list[bytes]:
    """One random mutation of a message."""
    frames = list(frames)
    choice = rng.randrange(7)
    index = rng.randrange(len(frames))
    frame = bytearray(frames[index])
    if choice == 0 and frame:  # flip bits
        for _ in range(rng.randrange(1, 8)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
    elif choice == 1:  # truncate
        del frame[rng.randrange(len(frame) + 1) :]
    elif choice == 2:  # splice in random bytes
        at = rng.randrange(len(frame) + 1)
        frame[at:at] = rng.randbytes(rng.randrange(1, 64))
    elif choice == 3:  # drop or add a frame
        if rng.random() < 0.5 and len(frames) > 1:
            del frames[rng.randrange(len(frames))]
        else:
            frames.append(rng.randbytes(rng.randrange(0, 64)))
        return frames
    elif choice == 4 and (header := _header(frames[0])) is not None:  # a hostile header value
        header[rng.choice([*header, "extra"])] = rng.choice(_HOSTILE_VALUES)
        return [msgpack.packb(header), *frames[1:]]
    elif choice == 5 and (header := _header(frames[0])) is not None:  # a hostile tensor descriptor
        header["tensors"] = [{"dtype": rng.choice(["float32", "object", "<f4", 7]),
                              "shape": rng.choice([[-1], [2**40, 2**40], [1] * 9, "x", [3]]),
                              "nbytes": rng.choice([12, 2**62, -4, 0])}]  # fmt: skip
        return [msgpack.packb(header), *frames[1:]]
    else:  # random bytes in place of the frame
        frame = bytearray(rng.randbytes(rng.randrange(0, 256)))
    frames[index] = bytes(frame)
    return frames


def _header(frame: bytes) -> dict[object, object] | None:
    """The header map of a (maybe already mutated) frame, or None."""
    try:
        header = msgpack.unpackb(frame, strict_map_key=False)
    except Exception:  # any garbage: mutate it some other way
        return None
    return header if isinstance(header, dict) else None


def hostile_messages(seed: int, sender: str) -> Iterator[list[bytes]]:
    """An endless stream of fuzzed messages (a quarter of them random bytes alone)."""
    rng = random.Random(seed)
    while True:
        if rng.random() < 0.25:
            yield [rng.randbytes(rng.randrange(0, 128)) for _ in range(rng.randrange(1, 4))]
        else:
            frames = valid_message(rng, sender)
            for _ in range(rng.randrange(1, 4)):
                frames = mutate(frames, rng)
            yield frames


def decodes(frames: list[bytes], limits: Limits = Limits()) -> bool:
    """Whether the decoder accepts ``frames`` (raising anything but WireError is a bug)."""
    try:
        decode(frames, limits)
    except WireError:
        return False
    return True
