"""Mixing neighbours' values piece by piece as they arrive (``gossip.buffers.pieces``), and the
transport handing large messages on chunk by chunk for it."""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from dataclasses import replace
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from helpers import average_in_threads, started_peers, started_transport

from gossip import DPSGD, SGP
from gossip.algorithms.sgp import MAX_SEGMENTS, _merged
from gossip.buffers.pieces import RunningMix
from gossip.buffers.vector import Layout
from gossipmesh.sim.memory import MemoryNetwork, MemoryPeer
from p2p.wire import CHUNK_BYTES, Message, Piece
from topologies import Topology

BF16 = np.dtype(ml_dtypes.bfloat16)


def _pieces(sender: str, vector: np.ndarray, layout: Layout, size: int) -> list[Message]:
    """``vector`` as the transport hands it on: chunks of ``size`` payload bytes, each a piece."""
    payload = np.concatenate([frame.reshape(-1).view(np.uint8) for frame in layout.pack(vector)])
    specs = tuple((np.dtype(d), (n,), n * np.dtype(d).itemsize) for d, n in layout.buckets)
    return [
        Message("params", sender, 0, (payload[start : start + size],), piece=Piece(start, specs))
        for start in range(0, payload.size, size)
    ]


def _add(mix: RunningMix, message: Message, weight: float) -> str | None:
    return mix.add(message.sender, message.tensors, message.piece, weight)


def _mix(own: np.ndarray, layout: Layout, self_weight: float = 1 / 3) -> RunningMix:
    return RunningMix(own, layout, self_weight, np.empty(16, own.dtype), contextlib.nullcontext())


def test_pieces_in_any_order_mix_to_the_weighted_mean() -> None:
    own, a, b = np.zeros(100), np.full(100, 3.0), np.arange(100.0)
    layout = Layout.of(own)
    mix = _mix(own, layout)
    pieces = _pieces("a", a, layout, 64) + _pieces("b", b, layout, 120)
    for index in np.random.default_rng(0).permutation(len(pieces)):
        assert _add(mix, pieces[index], 1 / 3) is None
    assert mix.complete("a") and mix.complete("b")
    np.testing.assert_allclose(own, (a + b) / 3, rtol=1e-14)
    assert mix.weights == [(0, pytest.approx(1.0))]


def test_a_neighbour_cut_off_mid_stream_counts_where_it_arrived() -> None:
    own, a, b = np.zeros(100), np.full(100, 3.0), np.full(100, 6.0)
    layout = Layout.of(own)
    mix = _mix(own, layout)
    for piece in _pieces("a", a, layout, 80)[:5]:  # elements 0..49 of a arrived, then a was gone
        assert _add(mix, piece, 1 / 3) is None
    for piece in _pieces("b", b, layout, 80):
        assert _add(mix, piece, 1 / 3) is None
    assert not mix.complete("a") and mix.complete("b")
    np.testing.assert_allclose(own[:50], 3.0)  # (0 + 3 + 6) / 3
    np.testing.assert_allclose(own[50:], 3.0)  # (0 + 6) / 2: a's weight renormalised away
    assert [(start, round(weight, 12)) for start, weight in mix.weights] == [(0, 1.0), (50, 0.666666666667)]
    assert ((own >= 0) & (own <= 6)).all()  # a convex combination everywhere


def test_a_bad_piece_refuses_its_message_only() -> None:
    own, a, b = np.zeros(60), np.full(60, 3.0), np.full(60, 6.0)
    a[45] = np.nan
    layout = Layout.of(own)
    mix = _mix(own, layout, 1 / 3)
    problems = [_add(mix, piece, 1 / 3) for piece in _pieces("a", a, layout, 160)]  # 20 elements each
    assert problems == [None, None, "non_finite"]
    assert [_add(mix, p, 1 / 3) for p in _pieces("b", b, layout, 160)] == [None] * 3
    assert np.isfinite(own).all()
    np.testing.assert_allclose(own[:32], 3.0)  # a's blocks before its bad one (16 elements each)
    np.testing.assert_allclose(own[48:], 3.0)  # (0 + 6) / 2
    again = _pieces("a", a, layout, 160)[0]
    assert _add(mix, again, 1 / 3) == "refused_message"


SPECS = ((np.dtype(np.float64), (100,), 800),)


@pytest.mark.parametrize(
    ("offset", "length", "specs", "reason"),
    [
        (3, 7, SPECS, "piece_misaligned"),  # not whole float64 values
        (0, 8, ((BF16, (4,), 8),), "tensor_mismatch"),  # another layout's piece
        (792, 16, SPECS, "piece_out_of_bounds"),  # past the payload's end
    ],
    ids=["misaligned", "other layout", "beyond the payload"],
)
def test_a_piece_that_does_not_fit_is_refused(
    offset: int, length: int, specs: tuple[tuple[np.dtype, tuple[int, ...], int], ...], reason: str
) -> None:
    own = np.zeros(100)
    piece = Message("params", "a", 0, (np.ones(length, np.uint8),), piece=Piece(offset, specs))
    assert _add(_mix(own, Layout.of(own)), piece, 0.5) == reason
    assert not own.any()


def test_the_same_bytes_twice_are_refused() -> None:
    own = np.zeros(40)
    layout = Layout.of(own)
    mix = _mix(own, layout, 0.5)
    first = _pieces("a", np.ones(40), layout, 160)
    assert _add(mix, first[0], 0.5) is None
    assert _add(mix, first[0], 0.5) == "duplicate_piece"


def test_bfloat16_buckets_are_widened_as_they_are_mixed() -> None:
    own = np.zeros(48, np.float32)
    layout = Layout(((BF16, 32), (np.dtype(np.float32), 16)))
    mix = _mix(own, layout, 0.5)
    value = np.linspace(-2, 2, 48).astype(np.float32)
    for piece in _pieces("a", value, layout, 24):
        assert _add(mix, piece, 0.5) is None
    expected = np.concatenate([value[:32].astype(BF16).astype(np.float32), value[32:]]) / 2
    np.testing.assert_allclose(own, expected, rtol=1e-7)


def test_the_transport_hands_a_stream_on_chunk_by_chunk_for_the_kinds_asked() -> None:
    vector = np.arange(CHUNK_BYTES // 4 * 2 + 10, dtype=np.float32)  # 3 chunks
    with (
        started_transport("rx", inbox_kinds={"params", "push"}) as receiver,
        started_transport("tx") as sender,
    ):
        receiver.take_pieces({"params"})
        sender.send(receiver.address, "params", 7, [vector])
        sender.send(receiver.address, "push", 7, [vector])
        payload = np.empty(vector.nbytes, np.uint8)
        offsets = []
        while sum(payload[o : o + CHUNK_BYTES].nbytes for o in offsets) < vector.nbytes:
            piece = receiver.recv(30, {"params"})
            assert piece is not None and piece.piece is not None, "a chunk did not come"
            offset = piece.piece.offset
            payload[offset : offset + piece.tensors[0].nbytes] = piece.tensors[0]
            offsets.append(offset)  # (and the piece let go of, as a reader does: its sender's credit)
            del piece
        whole = receiver.recv(30, {"push"})
    assert whole is not None and whole.piece is None
    np.testing.assert_array_equal(whole.tensors[0], vector)
    assert sorted(offsets) == [0, CHUNK_BYTES, 2 * CHUNK_BYTES]
    np.testing.assert_array_equal(payload.view(np.float32), vector)


def test_a_complete_graph_averages_streamed_values_exactly() -> None:
    """Three real nodes on 127.0.0.1, values of 3 chunks each, mixed as their pieces arrive."""
    size = CHUNK_BYTES // 8 * 2 + 1000
    vectors = [np.random.default_rng(i).standard_normal(size) for i in range(3)]
    mean = np.mean(vectors, axis=0)
    with started_peers(["a", "b", "c"]) as peers:
        average_in_threads(peers, vectors, topology="complete", rounds=1, timeout=30)
    for vector in vectors:
        np.testing.assert_allclose(vector, mean, rtol=0, atol=1e-12)


def test_weights_by_segment_mix_each_element_by_its_own_weights() -> None:
    """Push-sum's weights where shares were cut off: the node's and the sender's differ from
    segment to segment, and every element is the mean weighted by its own."""
    own, share = np.zeros(100), np.full(100, 6.0)
    layout = Layout.of(own)
    mix = RunningMix(own, layout, [(0, 1.0), (50, 2.0)], np.empty(16), contextlib.nullcontext())
    for piece in _pieces("a", share, layout, 96):
        assert mix.add(("a", 0), piece.tensors, piece.piece, [(0, 0.5), (30, 1.0)]) is None
    np.testing.assert_allclose(own[:30], 6.0 * 0.5 / 1.5)
    np.testing.assert_allclose(own[30:50], 6.0 * 1.0 / 2.0)
    np.testing.assert_allclose(own[50:], 6.0 * 1.0 / 3.0)
    assert mix.weights == [(0, 1.5), (30, 2.0), (50, 3.0)]


def test_a_push_sum_share_cut_off_mid_stream_keeps_every_element_exact() -> None:
    """SGP mixes a share piece by piece; one whose sender died after 40 elements leaves those
    with more weight than the rest, which the node keeps by segment and pushes on with its
    share: per element, the mesh's sums of w and w z are what they were."""
    network = MemoryNetwork()
    node, other = network.join("b"), network.join("a")
    own, theirs = np.zeros(100), np.full(100, 4.0)
    sgp = SGP(node, own, topology=Topology.parse("ring"), overlap=0, round_timeout=0.05)
    layout = sgp.vector_layout
    for piece in _pieces("a", theirs, layout, 80)[:4]:  # 40 elements, then "a" was gone
        node.put(replace(piece, kind="push", meta={"starts": [0], "weights": [0.5]}))
    sgp.after_step()
    # b kept half its weight (its other half went to a) and took a's share where it arrived
    assert sgp.segments == [(0, 1.0), (40, 0.5)]
    np.testing.assert_allclose(own[:40], 2.0)  # (0.5 * 0 + 0.5 * 4) / 1
    np.testing.assert_allclose(own[40:], 0.0)
    sgp.after_step()  # (nothing more comes: a is gone)
    shares = [other.recv(0, ("push",)) for _ in range(2)]
    assert [dict(share.meta) for share in shares if share is not None] == [
        {"starts": [0], "weights": [0.5]},
        {"starts": [0, 40], "weights": [0.5, 0.25]},  # its weights by segment, halved
    ]
    assert sgp.rejected.total() == 0


def test_a_push_sum_share_with_lying_weights_is_refused_whole() -> None:
    network = MemoryNetwork()
    node, _ = network.join("b"), network.join("a")
    own = np.zeros(10)
    sgp = SGP(node, own, topology=Topology.parse("ring"), overlap=0, round_timeout=0.05)
    for meta in (
        {"starts": [0], "weights": [1e9]},
        {"starts": [5], "weights": [0.5]},
        {"starts": [0, 0], "weights": [0.5, 0.5]},
        {"starts": [0], "weights": [float("nan")]},
        {"weights": [0.5]},
    ):
        node.put(Message("push", "a", 0, (np.full(10, 9.0),), meta=meta))
    sgp.after_step()
    np.testing.assert_array_equal(own, 0.0)
    assert sgp.rejected["bad_push_weight"] == 5


def test_push_sum_segments_of_nearly_equal_weight_are_joined_keeping_the_mass() -> None:
    segments = [(0, 1.0), (10, 1.0 + 1e-9), (20, 2.0)]
    assert _merged(segments, 30) == [(0, pytest.approx(1.0 + 0.5e-9, rel=1e-15)), (20, 2.0)]
    many = [(i, 1.0 + i) for i in range(MAX_SEGMENTS + 1)]  # too many for a share to carry
    ((start, weight),) = _merged(many, MAX_SEGMENTS + 1)
    assert start == 0 and weight == pytest.approx(np.mean([w for _, w in many]))


class _PacedPeer:
    """A node on a clock of its own, whose neighbour's pieces arrive ``step`` s apart on it; what
    it does not take of its network it hands on to ``peer``."""

    def __init__(self, peer: MemoryPeer, pieces: list[Message], step: float) -> None:
        self._peer, self._pieces, self._step, self._clock = peer, pieces, step, 0.0
        self._arrivals = [step * (k + 1) for k in range(len(pieces))]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._peer, name)

    def now(self) -> float:
        return self._clock

    def recv(self, timeout: float, kinds: Collection[str] | None = None) -> Message | None:
        """The next piece if it arrives within ``timeout`` (the clock moves to its arrival),
        else None once ``timeout`` has passed."""
        if self._arrivals and self._arrivals[0] <= self._clock + timeout:
            self._clock = max(self._clock, self._arrivals.pop(0))
            return self._pieces.pop(0)
        self._clock += timeout
        return None


def test_a_value_whose_pieces_keep_arriving_is_waited_for_past_the_wait_limit() -> None:
    """The wait limit (here the round timeout, 0.3 s) is one of silence: ten pieces 0.2 s apart
    (2 s in all) are all mixed in. Timed from the round's start, the wait ended at 0.3 s with
    one piece mixed in."""
    own, theirs = np.zeros(1000), np.full(1000, 4.0)
    network = MemoryNetwork()
    peer = _PacedPeer(network.join("a"), _pieces("b", theirs, Layout.of(own), own.nbytes // 10), 0.2)
    network.join("b")
    dpsgd = DPSGD(peer, own, topology=Topology("complete"), round_timeout=0.3, stragglers="wait")
    stats = dpsgd.after_step()
    np.testing.assert_allclose(own, 2.0)  # (0 + 4) / 2 in every element
    assert stats.arrived == 1 and peer.now() == pytest.approx(2.0)


class _SlowLinkPeer:
    """A node whose first push (to whichever out-neighbour) still leaves for the rest of the test."""

    def __init__(self, peer: MemoryPeer) -> None:
        self._peer = peer
        self.pushed_to: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._peer, name)

    def send(self, to: str, kind: str, round: int, *args: Any) -> None:
        if kind == "push":
            self.pushed_to.append(to)
        self._peer.send(to, kind, round, *args)

    def backlog(self, to: str) -> int:
        return int(to == self.pushed_to[0]) if self.pushed_to else 0


def test_sgp_holds_one_push_copy_keeping_its_shares_while_the_last_push_leaves() -> None:
    """On the one-peer exponential graph of 4 each round pushes to another out-neighbour. While
    round 0's push still leaves (its copy held), round 1 keeps its share rather than make a
    second copy: push-sum stays exact (the weight kept is the share not sent)."""
    network = MemoryNetwork()
    peer = _SlowLinkPeer(network.join("a"))
    for name in ("b", "c", "d"):
        network.join(name)
    sgp = SGP(peer, np.ones(1000), topology=Topology.parse("one-peer-exponential"), round_timeout=0.05)
    sgp.after_step()
    assert sgp.weight == pytest.approx(0.5)  # half of it pushed
    sgp.after_step()
    assert len(peer.pushed_to) == 1 and sgp.pace.sends_held == 1
    assert sgp.weight == pytest.approx(0.5)  # round 1's share kept


def test_a_neighbour_that_moved_past_the_round_without_its_value_is_not_waited_for() -> None:
    """A neighbour's value of round 1 arrives (at 0.1 s) while this node waits for its value of
    round 0, which it held back from its busy link: that one will not come, so the round ends
    there, mixing nothing, and the round-1 value waits for its round. The code before waited
    out the wait limit (5 s here) every such round."""
    own, theirs = np.zeros(1000), np.full(1000, 4.0)
    network = MemoryNetwork()
    ahead = [replace(piece, round=1) for piece in _pieces("b", theirs, Layout.of(own), own.nbytes)]
    peer = _PacedPeer(network.join("a"), ahead, 0.1)
    network.join("b")
    dpsgd = DPSGD(peer, own, topology=Topology("complete"), round_timeout=5.0)
    stats = dpsgd.after_step()
    assert stats.arrived == 0 and peer.now() == pytest.approx(0.1)
    np.testing.assert_array_equal(own, 0.0)
    dpsgd.after_step()  # round 1: its value is here
    np.testing.assert_allclose(own, 2.0)


def test_sgp_does_not_wait_for_a_share_its_sender_kept_and_moved_past() -> None:
    """SGP's awaited share of round 0 does not come once its sender's share of round 1 does (it
    kept the round-0 share for a busy link): the round ends at its arrival, not its wait limit."""
    own, theirs = np.zeros(1000), np.full(1000, 4.0)
    network = MemoryNetwork()
    share = {"starts": [0], "weights": [0.5]}
    ahead = [replace(p, kind="push", round=1, meta=share) for p in _pieces("b", theirs, Layout.of(own), 8000)]
    peer = _PacedPeer(network.join("a"), ahead, 0.1)
    network.join("b")
    sgp = SGP(peer, own, topology=Topology("complete"), overlap=0, round_timeout=5.0)
    stats = sgp.after_step()
    assert stats.arrived == 0 and peer.now() == pytest.approx(0.1)
    sgp.after_step()  # round 1: its share waited for it
    np.testing.assert_allclose(own, 8 / 3)  # its weight halved twice: (0.25 * 0 + 0.5 * 4) / 0.75
