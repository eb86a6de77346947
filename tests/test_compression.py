"""Compression: each codec's round trip and its checks on what it receives, CHOCO's public copies
(error feedback, lost messages) over the in-memory network, and CHOCO / local-steps meshes."""

from __future__ import annotations

import itertools
import json
import re
import sys
from contextlib import ExitStack, closing
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import average_in_threads, full_waits, run_together

from gossip import (
    CHOCO,
    Algorithm,
    Codec,
    CodecError,
    GossipOptimizer,
    IncompatibleOptionsError,
    consensus_distance,
)
from gossip.algorithms.choco_step import StepSize
from gossip.buffers.vector import CHUNK
from gossip.compression import INT8_BLOCK, SEGMENT, Int8, StreamedDecode
from gossip.optim.outer import OuterNesterov
from gossipmesh.sim.memory import MemoryNetwork, MemoryPeer
from node import main
from p2p.wire import Message, Piece
from topologies import SpecError, Topology

N = 10_000


def vector(seed: int = 0, n: int = N) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 3).astype(np.float32)


def round_trip(spec: str, x: np.ndarray) -> tuple[np.ndarray, int]:
    codec = Codec.parse(spec, seed=1)
    encoded = codec.encode(x)
    decoded = codec.decode(encoded.frames, encoded.meta, x.size)
    assert decoded.dtype == np.float32 and decoded.shape == x.shape
    return decoded, encoded.nbytes


def test_none_is_bit_exact() -> None:
    x = vector()
    decoded, nbytes = round_trip("none", x)
    assert np.array_equal(decoded, x) and nbytes == 4 * N


def test_fp16_and_bf16_round_to_nearest_within_half_an_ulp() -> None:
    x = vector()
    half, nbytes = round_trip("fp16", x)
    assert nbytes == 2 * N
    np.testing.assert_allclose(half, x, rtol=2**-11, atol=1e-7)
    brain, nbytes = round_trip("bf16", x)
    assert nbytes == 2 * N
    np.testing.assert_allclose(brain, x, rtol=2**-8, atol=0)
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, -2.5], dtype=np.float32)  # ties go to the even mantissa
    assert round_trip("bf16", ties)[0].tolist() == [1.0, 1 + 2**-6, -2.5]


def test_half_precision_codecs_keep_huge_values_finite() -> None:
    huge = np.array([1e6, -3.4e38, np.finfo(np.float32).max], dtype=np.float32)
    assert round_trip("fp16", huge)[0].tolist() == [65504.0, -65504.0, 65504.0]
    assert np.isfinite(round_trip("bf16", huge)[0]).all()


def test_int8_error_is_within_half_a_step_of_its_block_scale() -> None:
    x = vector()
    x[:INT8_BLOCK] = 0.0  # an all-zero block decodes to zeros
    decoded, nbytes = round_trip("int8", x)
    assert nbytes == N + 4 * -(-N // INT8_BLOCK)
    assert 4 * N / nbytes > 3.9
    blocks = -(-N // INT8_BLOCK)
    padded = np.zeros(blocks * INT8_BLOCK, dtype=np.float32)
    padded[:N] = x
    step = np.repeat(np.abs(padded.reshape(blocks, -1)).max(axis=1) / 127, INT8_BLOCK)[:N]
    assert (np.abs(decoded - x) <= step / 2 + 1e-6).all()
    assert not decoded[:INT8_BLOCK].any()


def test_int8_scales_are_each_blocks_largest_magnitude_over_127() -> None:
    """Whatever its sign, size or zeros' signs; a NaN or an infinity is refused."""
    x = vector()
    x[:INT8_BLOCK] = -0.0
    x[INT8_BLOCK : 2 * INT8_BLOCK] = np.float32(1e-42)  # (subnormal)
    x[2 * INT8_BLOCK + 3] = -1e30  # (the extreme is negative)
    scales, _ = Int8().encode(x).frames
    blocks = -(-N // INT8_BLOCK)
    padded = np.zeros(blocks * INT8_BLOCK, dtype=np.float32)
    padded[:N] = x
    expected = np.abs(padded.reshape(blocks, -1)).max(axis=1) / np.float32(127)
    assert np.array_equal(scales.view(np.int32), expected.view(np.int32))
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[3 * INT8_BLOCK + 1] = bad
        encoded = Int8().encode(y)
        with pytest.raises(CodecError, match="NaN or infinite"):
            Int8().check(encoded.frames, encoded.meta, N)


@pytest.mark.parametrize(
    ("fraction", "form", "nbytes"), [(0.01, "segments", 4 + 100 * 6), (0.2, "bitmap", N // 8 + 2000 * 4)]
)
def test_topk_keeps_exactly_the_largest_in_the_cheaper_format(
    fraction: float, form: str, nbytes: int
) -> None:
    x = vector()
    codec = Codec.parse(f"topk:{fraction},values=float32")
    encoded = codec.encode(x)
    assert encoded.meta == {"sparse": form} and encoded.nbytes == nbytes
    decoded = codec.decode(encoded.frames, encoded.meta, N)
    k = round(fraction * N)
    largest = np.argsort(-np.abs(x))[:k]
    assert np.array_equal(np.flatnonzero(decoded), np.sort(largest))
    assert np.array_equal(decoded[largest], x[largest])


def test_topk_with_int8_values_sends_3_bytes_a_value_and_rounds_them_within_half_a_step() -> None:
    codec = Codec.parse("topk:0.001")  # int8 values by default
    assert str(codec) == str(Codec.parse("topk:0.001,values=int8,dense_every=20")) == "topk:0.001"
    x = np.zeros(3 * SEGMENT + 5, dtype=np.float32)  # positions in four segments, one empty
    k = codec.kept(x.size)
    rng = np.random.default_rng(0)
    chosen = np.sort(rng.choice(SEGMENT, k - 5, replace=False))
    chosen = np.concatenate([chosen[:50], SEGMENT + chosen[50:], 3 * SEGMENT + np.arange(5)])
    x[chosen] = rng.normal(size=k).astype(np.float32) + 10 * np.sign(rng.normal(size=k))
    encoded = codec.encode(x)
    assert encoded.meta == {"sparse": "segments"}
    assert encoded.nbytes == 4 * 4 + 2 * k + k + 4 * -(-k // INT8_BLOCK)
    decoded = codec.decode(encoded.frames, encoded.meta, x.size)
    assert np.array_equal(np.flatnonzero(decoded), chosen)
    step = np.abs(x).max() / 127  # the values' blocks share at most this scale
    assert 0 < np.abs(decoded - x).max() <= step / 2 + 1e-6


def test_randk_keeps_k_exact_values_at_random_positions() -> None:
    x = vector()
    codec = Codec.parse("randk:0.05,values=float32", seed=3)
    first, second = (codec.encode(x) for _ in range(2))
    kept = [np.flatnonzero(codec.decode(e.frames, e.meta, N)) for e in (first, second)]
    assert all(k.size == 500 for k in kept) and not np.array_equal(kept[0], kept[1])
    decoded = codec.decode(first.frames, first.meta, N)
    assert np.array_equal(decoded[kept[0]], x[kept[0]])


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "int8", "topk:0.01"])
def test_a_difference_encodes_and_adds_chunk_by_chunk_as_it_decodes_whole(spec: str) -> None:
    """Encoding x - minus, and adding the decoded vector, go chunk by chunk (a vector of three
    chunks, the last short and ending mid int8 block): bit for bit what encoding the
    difference whole and decoding it give."""
    size = 2 * CHUNK + 1000
    x, minus = vector(1, size), vector(2, size)
    codec = Codec.parse(spec, seed=1)
    whole = codec.encode(x - minus)
    chunked = codec.encode(x, minus=minus)
    assert whole.meta == chunked.meta
    assert all(np.array_equal(a, b) for a, b in zip(whole.frames, chunked.frames, strict=True))
    decoded = codec.decode(whole.frames, whole.meta, size)
    y = minus.copy()
    codec.check(chunked.frames, chunked.meta, size)
    codec.add_decoded(y, chunked.frames, chunked.meta)
    assert np.array_equal(y, minus + decoded)


def _payload(frames: list[np.ndarray]) -> tuple[np.ndarray, list[tuple[np.dtype, tuple[int, ...], int]]]:
    """A message's payload bytes and its frames' specs, as the transport hands on pieces."""
    specs = [(f.dtype, f.shape, f.nbytes) for f in frames]
    return np.concatenate([f.reshape(-1).view(np.uint8) for f in frames]), specs


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "int8"])
def test_a_dense_message_decodes_into_a_sum_as_its_pieces_arrive(spec: str) -> None:
    """Pieces of 4 KiB down to 4 bytes, across the scales' frame into the values' and ending
    inside int8 blocks: the sum is bit for bit what adding the decoded message gives."""
    size = 2 * CHUNK + 1000
    codec = Codec.parse(spec)
    encoded = codec.encode(vector(1, size))
    payload, specs = _payload(encoded.frames)
    y, expected = vector(2, size), vector(2, size)
    codec.add_decoded(expected, encoded.frames, encoded.meta, scale=0.5)
    stream = StreamedDecode(codec, specs, y, 0.5)
    cuts = [0, 4, 1 << 12, *range(1 << 13, payload.size, 1 << 22), payload.size]
    for lo, hi in itertools.pairwise(cuts):
        assert not stream.complete
        stream.feed(payload[lo:hi], lo)
    assert stream.complete and np.array_equal(y, expected)


def test_a_streamed_message_is_refused_at_its_first_bad_piece() -> None:
    """Out of order, a value no encoder makes, a scale that is not finite: each refused with
    its reason, what came before it added."""
    size = 3000
    scales, q = Codec.parse("int8").encode(vector(1, size)).frames
    payload, specs = _payload([scales, q])
    y = np.zeros(size, np.float32)
    with pytest.raises(CodecError, match="piece_order"):
        StreamedDecode(Int8(), specs, y, 1.0).feed(payload[8:], 8)
    bad = payload.copy()
    bad[scales.nbytes + 2000] = np.uint8(128)  # q[2000] = -128
    stream = StreamedDecode(Int8(), specs, y, 1.0)
    stream.feed(bad[: scales.nbytes + 1024], 0)
    with pytest.raises(CodecError) as error:
        stream.feed(bad[scales.nbytes + 1024 :], scales.nbytes + 1024)
    assert error.value.reason == "codec_value" and np.count_nonzero(y[1024:]) == 0 < np.count_nonzero(y)
    nan = payload.copy()
    nan[:4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    with pytest.raises(CodecError, match="NaN"):
        StreamedDecode(Int8(), specs, y, 1.0).feed(nan, 0)
    with pytest.raises(CodecError) as error:
        StreamedDecode(Int8(), specs[1:], y, 1.0)
    assert error.value.reason == "codec_frames"


def test_int8_refuses_a_value_no_encoder_makes() -> None:
    """-128 at the largest scale would decode to -inf: checking refuses it without decoding."""
    scales, q = Codec.parse("int8").encode(vector()).frames
    q[5] = -128
    with pytest.raises(CodecError) as error:
        Codec.parse("int8").check([scales, q], {}, N)
    assert error.value.reason == "codec_value"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gzip", "unknown codec 'gzip'; choose one of none, fp16, bf16, int8, auto, topk:FRACTION"),
        ("topk", "topk: needs fraction, as in topk:FRACTION"),
        ("randk:0", "randk: fraction: must be in (0, 1], got 0.0"),
        ("topk:1.5", "topk: fraction: must be in (0, 1], got 1.5"),
        ("int8:3", "int8: unknown parameter '3'; it takes: none"),
    ],
)
def test_bad_compression_specs_say_what_is_accepted(spec: str, message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        Codec.parse(spec)


def _bitmap(bits: list[int]) -> list[np.ndarray]:
    return [np.array(bits, dtype=np.uint8), np.ones(2, dtype=np.float32)]


EXACT, SEGMENTS = "topk:0.2,values=float32", {"sparse": "segments"}  # float32 values: frames by hand


def _segments(counts: list[int], offsets: list[int], values: list[float]) -> list[np.ndarray]:
    return [np.array(counts, np.uint32), np.array(offsets, np.uint16), np.array(values, np.float32)]


@pytest.mark.parametrize(
    ("spec", "frames", "meta", "reason"),
    [
        ("none", [np.zeros(9, np.float32)], {}, "codec_shape"),
        ("none", [np.zeros(10, np.float64)], {}, "codec_shape"),
        ("int8", [np.zeros(10, np.int8)], {}, "codec_frames"),
        ("int8", [np.array([np.inf], np.float32), np.zeros(10, np.int8)], {}, "non_finite"),
        (EXACT, _segments([2], [1, 12], [1.0, 2.0]), SEGMENTS, "codec_index"),
        (EXACT, _segments([2], [3, 3], [1.0, 2.0]), SEGMENTS, "codec_index"),
        (EXACT, _segments([3], [1, 2], [1.0, 2.0]), SEGMENTS, "codec_index"),
        (EXACT, _segments([2**32 - 1], [1, 2], [1.0, 2.0]), SEGMENTS, "codec_index"),
        (EXACT, _segments([2], [1, 2], [1.0, np.nan]), SEGMENTS, "non_finite"),
        (EXACT, _segments([2], [1, 2], [1.0, 2.0]), {"sparse": "zip"}, "codec_format"),
        (EXACT, _segments([2], [1, 2], [1.0, 2.0])[1:], SEGMENTS, "codec_shape"),
        ("topk:0.2", _segments([2], [1, 2], [1.0, 2.0]), SEGMENTS, "codec_frames"),
        (EXACT, _bitmap([0b111, 0]), {"sparse": "bitmap"}, "codec_index"),  # 3 marked, 2 values
        (EXACT, _bitmap([0b11, 0b1000000]), {"sparse": "bitmap"}, "codec_index"),  # bit 14 of 10
    ],
)  # fmt: skip
def test_malformed_compressed_vectors_are_refused_with_a_reason(
    spec: str, frames: list[np.ndarray], meta: dict[str, str], reason: str
) -> None:
    with pytest.raises(CodecError) as error:
        Codec.parse(spec).decode(frames, meta, 10)
    assert error.value.reason == reason


# -- CHOCO over the in-memory network ---------------------------------------------------------


def test_the_public_copy_takes_in_what_compression_dropped() -> None:
    """Error feedback: each round sends the top 10% of x - x̂ and the rest stays in the residual,
    so a lone node's public copy catches up with its model's change."""
    x = vector(n=2000)
    choco = CHOCO(
        MemoryNetwork().join("solo"),
        x,
        topology=Topology.parse("ring"),
        codec=Codec.parse("topk:0.1,values=float32"),
    )
    x += vector(seed=1, n=2000)  # a local step the public copy has not seen
    residuals = [np.abs(x - choco.public).sum()]
    for _ in range(10):
        before = x - choco.public
        choco.after_step()
        after = x - choco.public
        sent = after != before
        assert np.count_nonzero(sent) == 200
        assert (np.abs(after[sent]) <= 1e-6 * np.abs(x[sent])).all()  # what was sent is no longer owed
        assert np.array_equal(after[~sent], before[~sent])  # ... and nothing else was lost
        residuals.append(np.abs(after).sum())
    assert all(b < a for a, b in itertools.pairwise(residuals))
    assert residuals[-1] < 1e-6 * residuals[0]  # 10 rounds of 10% cover every element


@pytest.mark.parametrize(("compression", "rounds"), [("int8", 150), ("topk:0.1", 400)])
def test_choco_pure_averaging_keeps_the_mean_and_reaches_it(compression: str, rounds: int) -> None:
    network = MemoryNetwork()
    peers = [network.join(f"node-{i}") for i in range(8)]
    vectors = [vector(seed, 500) + 5 for seed in range(8)]
    target = np.mean(vectors, axis=0)
    average_in_threads(
        peers, vectors, topology="ring", rounds=rounds, algorithm="choco", compression=compression
    )
    # Exact up to float32 rounding when every q is in time; a neighbour's q that misses its
    # round's bounded wait (a thread not scheduled for 50 ms on a loaded machine) moves the mean
    # by about 1e-3. An asymmetric mix, the bug this guards against, moved it by 2.
    np.testing.assert_allclose(np.mean(vectors, axis=0), target, atol=1e-2)
    assert consensus_distance(vectors) < 1e-4


def test_choco_pairs_mix_at_the_smaller_step_size_and_keep_the_mean() -> None:
    """Nodes configured with different γ: each pair mixes at the smaller of its two (named in
    every update), so the pair terms cancel; mixing each at its own γ moved it by up to 2.4."""
    network = MemoryNetwork()
    peers = [network.join(f"node-{i}") for i in range(6)]
    vectors = [vector(seed, 500) + 5 for seed in range(6)]
    target = np.mean(vectors, axis=0)
    gammas = [1.0, 0.3, 0.6, 1.0, 0.2, 0.8]
    algorithms = [f"choco:gamma={g}" for g in gammas]
    average_in_threads(peers, vectors, topology="ring", rounds=200, algorithm=algorithms, compression="int8")
    np.testing.assert_allclose(np.mean(vectors, axis=0), target, atol=1e-2)
    assert consensus_distance(vectors) < 1e-4


def test_choco_sparse_step_size_follows_what_its_messages_carry() -> None:
    """Top-10% left to its default γ (the running share of the owed difference a message
    carries: about 0.35 here) averages many times closer in 200 rounds than at the fixed
    γ = 0.2 (twice the fraction) it replaced, and keeps the mean."""

    def distance_after(algorithm: str) -> float:
        network = MemoryNetwork()
        peers = [network.join(f"node-{i}") for i in range(8)]
        vectors = [vector(seed, 500) + 5 for seed in range(8)]
        target = np.mean(vectors, axis=0)
        average_in_threads(
            peers, vectors, topology="ring", rounds=200, algorithm=algorithm, compression="topk:0.1"
        )
        np.testing.assert_allclose(np.mean(vectors, axis=0), target, atol=1e-2)
        return consensus_distance(vectors)

    adaptive, fixed = distance_after("choco"), distance_after("choco:gamma=0.2")
    assert adaptive < 0.2 * fixed, (adaptive, fixed)


def test_choco_step_size_is_fixed_for_dense_codecs_and_adapts_for_sparse_ones() -> None:
    owed, carried = 25.0, 16.0  # |d|² of d = (3, -4, 0, 0); |Q(d)|² of Q(d) = (0, -4, 0, 0)
    topk, int8 = Codec.parse("topk:0.25"), Codec.parse("int8")
    assert StepSize(None).update(int8, owed, carried) == 1.0
    assert StepSize(0.3).update(topk, owed, carried) == 0.3
    adaptive = StepSize(None)
    assert adaptive.measures(topk) and not adaptive.measures(int8) and not StepSize(0.3).measures(topk)
    assert adaptive.update(topk, owed, carried) == pytest.approx(0.64)
    assert adaptive.update(topk, owed, owed) == pytest.approx(0.9 * 0.64 + 0.1 * 1.0)
    assert adaptive.update(int8, owed, carried) == 1.0  # a dense round leaves the quality be
    assert adaptive.update(topk, 0.0, carried) == pytest.approx(0.676)  # none owed
    with pytest.raises(ValueError, match=re.escape("CHOCO: gamma must be in (0, 1], got 1.5")):
        StepSize(1.5)


def test_a_sparse_codec_sends_every_dense_every_th_round_as_int8() -> None:
    codec = Codec.parse("topk:0.01,dense_every=4")
    sparse = "topk:0.01,dense_every=4"
    assert [str(codec.for_round(r)) for r in range(8)] == [*[sparse] * 3, "int8", *[sparse] * 3, "int8"]
    assert str(codec.for_message({"codec": "int8"})) == "int8"
    with pytest.raises(CodecError, match="codec_mismatch"):
        Codec.parse("topk:0.01,dense_every=0").for_message({"codec": "int8"})  # no dense rounds


class LosesOneUpdate:
    """A node's endpoint that loses its round-5 q to node-1, as a reset connection would."""

    def __init__(self, peer: MemoryPeer) -> None:
        self._peer = peer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._peer, name)

    def send(self, to: str, kind: str, round: int, tensors: Any = (), meta: Any = None) -> None:
        if not (kind == "choco" and round == 5 and to == "node-1"):
            self._peer.send(to, kind, round, tensors, meta)


@pytest.mark.parametrize("gamma", [None, 1.0])  # the neighbours' copies summed; one replica each
def test_a_lost_update_is_repaired_with_a_full_copy(gamma: float | None) -> None:
    network = MemoryNetwork()
    peers: list[Any] = [
        network.join("node-0"),
        network.join("node-1"),
        LosesOneUpdate(network.join("node-2")),
    ]
    vectors = [vector(seed, 300) for seed in range(3)]
    choco = [
        CHOCO(p, v, topology=Topology.parse("ring"), codec=Codec.parse("int8"), gamma=gamma)
        for p, v in zip(peers, vectors, strict=True)
    ]
    run_together((lambda c=c: [c.after_step() for _ in range(20)]) for c in choco)
    for holder in (0, 1):
        held = choco[holder]._replicas["node-2"]
        assert held.value is not None
        if gamma is None:  # the sum of both neighbours' public copies, by their weights
            weights = choco[holder]._weights
            expected = sum(w * choco[int(j[-1])].public for j, w in weights.items())
            np.testing.assert_allclose(held.value, expected, rtol=1e-5, atol=1e-6)
        else:
            assert np.array_equal(held.value, choco[2].public)
    assert choco[2].full_copies_sent == 1  # after the gap (at the start, replicas begin at 0)
    # node-1's sum, that of both its neighbours, starts again from both their copies
    assert [c.sum_restarts for c in choco] == ([0, 1, 0] if gamma is None else [0, 0, 0])
    assert choco[0].full_copies_sent == (1 if gamma is None else 0)


class StreamsUpdates:
    """A node's endpoint whose CHOCO updates reach their receivers as the transport hands on a
    large message: pieces of ``size`` payload bytes (int8's scales and values cut across)."""

    def __init__(
        self,
        peer: MemoryPeer,
        size: int = 1000,
        corrupt: tuple[str, int] | None = None,
        cut: tuple[str, int] | None = None,
        reverse: bool = False,
    ) -> None:
        self._peer, self._size = peer, size
        self._corrupt = corrupt  # (receiver, round): an int8 value of that update set to -128
        self._cut = cut  # (receiver, round): that update's last piece never comes
        self._reverse = reverse  # the pieces come last first (as over several connections)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._peer, name)

    def send(self, to: str, kind: str, round: int, tensors: Any = (), meta: Any = None) -> None:
        if kind != "choco":
            self._peer.send(to, kind, round, tensors, meta)
            return
        payload, specs = _payload([np.asarray(t) for t in tensors])
        if self._corrupt == (to, round):
            payload[-10] = np.uint8(128)  # (in the last piece: the first ones are in the sum already)
        starts = list(range(0, payload.size, self._size))
        if self._cut == (to, round):
            starts.pop()
        for lo in reversed(starts) if self._reverse else starts:
            piece = Piece(lo, tuple(specs))
            chunk = (payload[lo : lo + self._size].copy(),)
            self._peer.network.deliver(to, Message(kind, self.node_id, round, chunk, meta or {}, piece=piece))


@pytest.mark.parametrize("reverse", [False, True], ids=["in order", "last first"])
@pytest.mark.parametrize("stragglers", ["wait", "tolerate"])
def test_choco_adds_updates_to_its_sum_as_their_pieces_arrive(stragglers: str, reverse: bool) -> None:
    """A ring of 4 whose updates come piece by piece (three pieces of 1 KB each), in order or
    last first (a stream spread over several connections, ``--streams``, comes in any order):
    waiting for every neighbour, the same models as whole updates give (the int8 values scaled
    by a pair's weight round differently) and the mean kept; either way one model reached and no
    update held whole. (Tolerating stragglers, a node a busy machine delays is mixed at an older
    round, which moves the mean: the CHOCO docstring.)"""
    results = []
    for streamed in (False, True):
        network = MemoryNetwork()
        peers: list[Any] = [network.join(f"node-{i}") for i in range(4)]
        if streamed:
            peers = [StreamsUpdates(p, reverse=reverse) for p in peers]
        vectors = [vector(seed, 2500) for seed in range(4)]
        target = np.mean(vectors, axis=0)
        with full_waits():  # (waiting, a busy machine must not make a node give up on one)
            choco = [
                CHOCO(p, v, topology=Topology.parse("ring"), codec=Codec.parse("int8"), stragglers=stragglers)
                for p, v in zip(peers, vectors, strict=True)
            ]
            run_together((lambda c=c: [c.after_step() for _ in range(30)]) for c in choco)
        if stragglers == "wait":
            np.testing.assert_allclose(np.mean(vectors, axis=0), target, atol=1e-2)
        assert consensus_distance(vectors) < 1e-4
        assert all(not r.pending for c in choco for r in c._replicas.values())
        assert [(c.sum_restarts, dict(c.rejected)) for c in choco] == [(0, {})] * 4
        results.append(vectors)
    if stragglers == "wait":
        for whole, pieces in zip(*results, strict=True):
            np.testing.assert_allclose(pieces, whole, rtol=0, atol=1e-4)


def test_a_bad_piece_refuses_its_update_and_the_sum_starts_again() -> None:
    """node-2's round-5 update to node-1 ends with an int8 value no encoder makes: node-1
    refuses it there, its sum (which holds that update's first pieces) starts again from full
    copies, and the mesh goes on to one model."""
    network = MemoryNetwork()
    peers: list[Any] = [
        StreamsUpdates(network.join("node-0")),
        StreamsUpdates(network.join("node-1")),
        StreamsUpdates(network.join("node-2"), corrupt=("node-1", 5)),
    ]
    vectors = [vector(seed, 2500) for seed in range(3)]
    choco = [
        CHOCO(p, v, topology=Topology.parse("ring"), codec=Codec.parse("int8"))
        for p, v in zip(peers, vectors, strict=True)
    ]
    run_together((lambda c=c: [c.after_step() for _ in range(20)]) for c in choco)
    assert [(c.sum_restarts, dict(c.rejected)) for c in choco] == [(0, {}), (1, {"codec_value": 1}), (0, {})]
    assert consensus_distance(vectors) < 1e-4 and all(np.isfinite(v).all() for v in vectors)


@pytest.mark.parametrize("reverse", [False, True], ids=["in order", "last first"])
def test_a_lost_streamed_update_is_repaired_with_full_copies(reverse: bool) -> None:
    """As with whole updates: node-2's round-5 update to node-1 is lost; node-1's sum starts
    again from its neighbours' full copies, the updates that come meanwhile put together whole
    (from pieces in whatever order they come) and added after them."""
    network = MemoryNetwork()
    peers: list[Any] = [
        StreamsUpdates(network.join("node-0"), reverse=reverse),
        StreamsUpdates(network.join("node-1"), reverse=reverse),
        LosesOneUpdate(StreamsUpdates(network.join("node-2"), reverse=reverse)),
    ]
    vectors = [vector(seed, 2500) for seed in range(3)]
    choco = [
        CHOCO(p, v, topology=Topology.parse("ring"), codec=Codec.parse("int8"))
        for p, v in zip(peers, vectors, strict=True)
    ]
    run_together((lambda c=c: [c.after_step() for _ in range(20)]) for c in choco)
    assert [c.sum_restarts for c in choco] == [0, 1, 0]
    held = choco[1]._sum
    expected = sum(w * choco[int(j[-1])].public for j, w in choco[1]._weights.items())
    np.testing.assert_allclose(held, expected, rtol=1e-5, atol=1e-5)
    assert consensus_distance(vectors) < 1e-4


def test_an_update_cut_off_mid_stream_starts_the_sum_again() -> None:
    """node-2's round-5 update to node-1 loses its last piece (its connection closed): its
    first pieces are in node-1's sum and the rest never comes. After five round timeouts
    without a piece node-1 starts its sum again from full copies, and the mesh reaches one
    model; until then it waits for node-2 as for a late neighbour."""
    network = MemoryNetwork()
    peers: list[Any] = [
        StreamsUpdates(network.join("node-0")),
        StreamsUpdates(network.join("node-1")),
        StreamsUpdates(network.join("node-2"), cut=("node-1", 5)),
    ]
    vectors = [vector(seed, 2500) for seed in range(3)]
    choco = [
        CHOCO(p, v, topology=Topology.parse("ring"), codec=Codec.parse("int8"), round_timeout=0.05)
        for p, v in zip(peers, vectors, strict=True)
    ]

    def run(node: CHOCO) -> None:  # (rounds until node-1 has started again, then 30 more)
        while not choco[1].sum_restarts:
            node.after_step()
        for _ in range(30):
            node.after_step()

    run_together(partial(run, c) for c in choco)
    assert [(c.sum_restarts, c.dropped["choco_stream_cut"]) for c in choco] == [(0, 0), (1, 1), (0, 0)]
    expected = sum(w * choco[int(j[-1])].public for j, w in choco[1]._weights.items())
    np.testing.assert_allclose(choco[1]._sum, expected, rtol=1e-5, atol=1e-5)
    assert consensus_distance(vectors) < 1e-4


class SendsFullCopiesTwice:
    """A node's endpoint that sends each full copy again after its third update since, as a
    second answer that those updates overtook would come."""

    def __init__(self, peer: Any) -> None:
        self._peer = peer
        self._again: list[tuple[Any, ...]] = []  # (updates to wait for, the copy's send)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._peer, name)

    def send(self, to: str, kind: str, round: int, tensors: Any = (), meta: Any = None) -> None:
        self._peer.send(to, kind, round, tensors, meta)
        if kind == "choco_full":
            self._again.append((3, (to, kind, round, tensors, meta)))
        elif kind == "choco":
            waiting = [(n - (copy[0] == to), copy) for n, copy in self._again]
            self._again = [(n, copy) for n, copy in waiting if n]
            for _, copy in [(n, copy) for n, copy in waiting if not n]:
                self._peer.send(*copy)


@pytest.mark.parametrize("gamma", [None, 1.0])
def test_a_full_copy_older_than_the_replica_is_ignored(gamma: float | None) -> None:
    """node-2's round-5 update to node-1 is lost; node-1 asks for node-2's full copy, and
    gets it again three updates later: the second, older than what node-1 holds, is ignored
    (neither the sum nor the replica goes back to it) and the mesh reaches one model."""
    network = MemoryNetwork()
    peers: list[Any] = [
        network.join("node-0"),
        network.join("node-1"),
        SendsFullCopiesTwice(LosesOneUpdate(network.join("node-2"))),
    ]
    vectors = [vector(seed, 300) for seed in range(3)]
    choco = [
        CHOCO(p, v, topology=Topology.parse("ring"), codec=Codec.parse("int8"), gamma=gamma)
        for p, v in zip(peers, vectors, strict=True)
    ]
    run_together((lambda c=c: [c.after_step() for _ in range(20)]) for c in choco)
    assert [c.sum_restarts for c in choco] == ([0, 1, 0] if gamma is None else [0, 0, 0])
    assert choco[2].full_copies_sent == 1 and choco[1].dropped["choco_stale_copy"] == 1
    assert consensus_distance(vectors) < 1e-4


@pytest.mark.parametrize("gamma", [None, 1.0])
def test_choco_holds_its_neighbours_copies_as_one_sum_where_every_pair_mixes_at_gamma_1(
    gamma: float | None,
) -> None:
    """On a complete graph of 5 (4 neighbours each) a node at the default γ holds two vectors
    of the model's size, x̂ and the sum of its neighbours' copies; with a γ set by hand, which
    may differ between nodes, one replica per neighbour. Both keep the mean and reach it."""
    network = MemoryNetwork()
    peers = [network.join(f"node-{i}") for i in range(5)]
    vectors = [vector(seed, 400) + 5 for seed in range(5)]
    target = np.mean(vectors, axis=0)
    choco = [
        CHOCO(p, v, topology=Topology.parse("complete"), codec=Codec.parse("int8"), gamma=gamma)
        for p, v in zip(peers, vectors, strict=True)
    ]
    run_together((lambda c=c: [c.after_step() for _ in range(40)]) for c in choco)
    for node in choco:
        held = {id(replica.value) for replica in node._replicas.values()}
        assert len(node._replicas) == 4 and id(node.public) not in held
        if gamma is None:
            assert held == {id(node._sum)}
        else:
            assert len(held) == 4
    np.testing.assert_allclose(np.mean(vectors, axis=0), target, atol=1e-2)
    assert consensus_distance(vectors) < 1e-4


class DeclaresDeadMidRound:
    """node-0's endpoint on which node-3 is declared dead between round 10's row and the wait
    for it (from round 11 on node-3 is gone for every node)."""

    def __init__(self, peer: MemoryPeer) -> None:
        self._peer = peer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._peer, name)

    def members(self, round: int | None = None) -> frozenset[str]:
        members = self._peer.members(round)
        if round == 10 and sys._getframe(1).f_code.co_name == "_gather":
            return members - {"node-3"}
        return members


@pytest.mark.parametrize("dies_mid_round", [False, True], ids=["leaves", "declared dead mid-round"])
def test_choco_starts_its_sum_again_when_a_neighbour_leaves(dies_mid_round: bool) -> None:
    """A ring of 4 at the default γ; node-3 leaves after round 9, or node-0 learns it died
    after making round 10's row (its share then stays in node-0's sum for that round and goes
    out with round 11's row). Its two neighbours cannot take its copy out of their sums: they
    start them again from their new neighbours' copies (node-1's row is unchanged, 1/3 each on
    a ring of 3 as of 4), and the three reach one model."""
    network = MemoryNetwork()
    peers: list[Any] = [network.join(f"node-{i}") for i in range(4)]
    last = 10 if dies_mid_round else 9
    if dies_mid_round:
        peers[0] = DeclaresDeadMidRound(peers[0])
    network.leave("node-3", after_round=last)
    vectors = [vector(seed, 400) for seed in range(4)]
    choco = [
        CHOCO(p, v, topology=Topology.parse("ring"), codec=Codec.parse("int8"))
        for p, v in zip(peers, vectors, strict=True)
    ]
    rounds = [40, 40, 40, last + 1]
    run_together(
        (lambda c=c, n=n: [c.after_step() for _ in range(n)]) for c, n in zip(choco, rounds, strict=True)
    )
    assert [c.sum_restarts for c in choco[:3]] == [1, 0, 1]
    assert choco[0]._weights.keys() == {"node-1", "node-2"}
    replicas, summed = choco[0]._replicas, choco[0]._sum
    assert all(r.value is summed for r in replicas.values()), {  # (what each waits for, if one fails)
        j: (r.value is summed, r.next_round, sorted(r.pending)) for j, r in replicas.items()
    }
    expected = sum(w * choco[int(j[-1])].public for j, w in choco[0]._weights.items())
    np.testing.assert_allclose(choco[0]._sum, expected, rtol=1e-5, atol=1e-5)
    assert consensus_distance(vectors[:3]) < 1e-4 and np.isfinite(vectors[0]).all()


def test_outer_nesterov_step_matches_its_definition() -> None:
    params = np.array([1.0, 2.0], dtype=np.float32)
    outer = OuterNesterov(params, lr=0.5, momentum=0.9)
    params[:] = [0.0, 2.0]  # mixed after H inner steps: pseudo-gradient (1, 0)
    outer.step(params)
    np.testing.assert_allclose(params, [1 - 0.5 * (1 + 0.9 * 1), 2.0], rtol=1e-6)  # v = g; g + μ v
    params -= [0.1, 0.0]  # pseudo-gradient (0.1, 0): v = 0.9 + 0.1
    outer.step(params)
    np.testing.assert_allclose(params, [0.05 - 0.5 * (0.1 + 0.9 * 1.0), 2.0], rtol=1e-6)


def test_a_round_that_mixed_too_little_takes_no_outer_step() -> None:
    """The outer momentum extrapolates a neighbourhood's progress: a round that mixed in under
    half of the values it expected, none, or that caught up with the mesh, keeps the parameters as
    they are for the anchor, and the momentum for the next round that takes the step."""
    params = np.array([1.0, 2.0], dtype=np.float32)
    outer = OuterNesterov(params, lr=0.5, momentum=0.9)
    params[:] = [0.0, 2.0]
    assert outer.after_mixing(params, expected=2, arrived=1)  # half of them: the outer step
    np.testing.assert_allclose(params, [1 - 0.5 * (1 + 0.9 * 1), 2.0], rtol=1e-6)
    velocity = outer.velocity.copy()
    params -= [0.1, 0.0]
    alone = params.copy()
    assert not outer.after_mixing(params, expected=2, arrived=0)
    np.testing.assert_array_equal(params, alone)
    np.testing.assert_array_equal(outer.anchor, alone)
    np.testing.assert_array_equal(outer.velocity, velocity)
    # no neighbour to mix with (its neighbours left, or a mesh of one): its own progress alone
    assert not outer.after_mixing(params, expected=0, arrived=0)
    assert outer.rounds_held == 2
    caught_up = params + 5.0  # a straggler's round that skipped to the mesh's: all came
    params[:] = caught_up
    velocity = outer.velocity.copy()
    assert not outer.after_mixing(params, expected=2, arrived=2, caught_up=True)
    np.testing.assert_array_equal(params, caught_up)
    np.testing.assert_array_equal(outer.anchor, caught_up)
    np.testing.assert_array_equal(outer.velocity, velocity)
    assert outer.rounds_held == 3


def test_with_an_outer_step_the_consensus_estimate_is_what_mixing_moved() -> None:
    """Two nodes at 1 and 3 that take no local steps (lr 0): the round mixes both to 2, and the
    outer step then moves each further (to 1 + 0.7 * 1.9 = 2.33 from 1); the estimate is
    |2 - 1| / |2| = 0.5, the mixing's alone, not the outer step's 0.57."""
    network = MemoryNetwork()
    params = [torch.nn.Parameter(torch.full((4,), start)) for start in (1.0, 3.0)]
    optimizers = [
        GossipOptimizer(
            torch.optim.SGD([p], lr=0.0), peer=network.join(f"n{i}"), topology=Topology("complete"),
            average_every=10, outer_lr=0.7, outer_momentum=0.9,
        )
        for i, p in enumerate(params)
    ]  # fmt: skip

    def train(i: int) -> None:
        for _ in range(10):
            params[i].grad = torch.zeros(4)
            optimizers[i].step()

    with ExitStack() as stack:
        for optimizer in optimizers:
            stack.enter_context(closing(optimizer))
        run_together(partial(train, i) for i in range(2))
        assert optimizers[0].round == 1
        np.testing.assert_allclose(params[0].detach().numpy(), 1 + 0.7 * 1.9, rtol=1e-6)
        assert optimizers[0].consensus_estimate == pytest.approx(0.5, rel=1e-6)
        assert optimizers[1].consensus_estimate == pytest.approx(1 / 2, rel=1e-6)  # |2 - 3| / |2|


def test_an_overlapped_outer_step_is_guarded_by_what_the_last_round_mixed() -> None:
    """With ``overlap=1`` the outer step comes before the round's mixing, on the node's own
    progress: after a round that mixed none of its neighbour's values (a member that never
    sends) it is held, as it is after a round that mixes too little without overlap."""
    network = MemoryNetwork()
    network.join("silent")  # a member whose values never come
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = GossipOptimizer(
        torch.optim.SGD([param], lr=0.1), peer=network.join("a"), topology=Topology("complete"),
        algorithm=Algorithm.parse("dpsgd:overlap=1"), average_every=10, outer_lr=0.7, round_timeout=0.05,
    )  # fmt: skip
    with closing(optimizer):
        for _ in range(50):
            param.grad = torch.ones(4)
            optimizer.step()
        assert optimizer.round == 5
        # rounds 1 and 2 follow no round that mixed a value (the first overlapped round mixes
        # nothing); rounds 3-5 follow rounds that expected one and mixed none: none steps
        assert optimizer.outer is not None and optimizer.outer.rounds_held == 5


def test_compression_needs_choco_and_choco_needs_a_static_graph() -> None:
    network = MemoryNetwork()
    with pytest.raises(ValueError, match="compression=int8 needs algorithm=choco"):
        Algorithm.parse("dpsgd").build(
            network.join("a"),
            vector(),
            topology=Topology.parse("ring"),
            round_timeout=1,
            lock=None,
            codec=Codec.parse("int8"),
        )
    with pytest.raises(IncompatibleOptionsError, match="algorithm=choco needs a static undirected topology="):
        CHOCO(network.join("b"), vector(), topology=Topology.parse("one-peer-exponential"), codec=Codec())


# -- meshes ------------------------------------------------------------------------------------

DPSGD_BYTES = 600 * 2 * 4 * 9610  # 600 rounds, a float32 model to each of 2 ring neighbours


@pytest.mark.mesh
@pytest.mark.parametrize(
    ("flags", "fewer_bytes"),
    [
        (["--algorithm", "choco", "--compression", "int8"], 3.5),
        (["--algorithm", "choco", "--compression", "topk:0.01"], 10),
        (["--local-steps", "10"], 8),
        (["--local-steps", "10", "--algorithm", "dpsgd:overlap=1"], 8),
    ],
)
def test_compressed_and_local_steps_meshes_reach_the_target(
    tmp_path: Path, flags: list[str], fewer_bytes: float, no_other_threads: None
) -> None:
    report_path = tmp_path / "report.json"
    argv = ["mesh", "--report", str(report_path), "--run-dir", str(tmp_path), "--plot", "none", "--insecure"]
    assert main([*argv, *flags]) == 0
    for node in json.loads(report_path.read_text())["nodes"]:
        assert node["status"] == "finished" and node["steps"] == 600
        assert node["final"]["accuracy"] >= 0.93, node["final"]
        assert node["bytes_sent"] * fewer_bytes < DPSGD_BYTES, node["bytes_sent"]
        assert node["timeline"][-1]["bytes_sent"] <= node["bytes_sent"]
