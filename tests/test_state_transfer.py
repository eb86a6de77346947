"""Joining with state: a windowed, resumable pull of chunks from one or several sources."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from helpers import HANG_S, in_background, started_peers, wait_until

import gossip.state.server
from gossip import GossipOptimizer
from gossip.messages import STATE_CHUNK as CHUNK
from gossip.messages import STATE_MANIFEST as MANIFEST
from gossip.messages import STATE_REQUEST as REQUEST
from gossip.messages import STATE_VERSION
from gossip.network import PeerNetwork, PeerWrapper
from gossip.state.fetch import fetch_state
from gossip.state.manifest import (
    MAX_WINDOW,
    Snapshot,
    StateTransferError,
    StateView,
)
from gossip.state.server import StateServer
from gossipmesh.sim.memory import MemoryNetwork
from topologies import Topology

CHUNK_BYTES = 320


@contextmanager
def serving(peer: PeerNetwork, view: StateView) -> Iterator[StateServer]:
    """Answer state requests on a thread, as a training loop does between its steps."""
    server = StateServer(peer, view)
    with in_background(server.serve):
        yield server


class Lossy(PeerWrapper):
    """A source's network that loses the chunks ``lose(index)`` says, and counts what it sent."""

    def __init__(self, peer: PeerNetwork, lose: Callable[[int], bool] = lambda _: False) -> None:
        super().__init__(peer)
        self.lose = lose
        self.sent: Counter[int] = Counter()

    def send(
        self,
        to: str,
        kind: str,
        round: int,
        tensors: Sequence[np.ndarray] = (),
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        if kind == CHUNK:
            assert meta is not None
            self.sent[meta["index"]] += 1
            if self.lose(meta["index"]):
                return
        super().send(to, kind, round, tensors, meta)


def _state(seed: int = 0, size: int = 1000) -> Snapshot:
    rng = np.random.default_rng(seed)
    return Snapshot(
        {
            "params": rng.standard_normal(size).astype(np.float32),
            "optimizer.momentum_buffer": rng.standard_normal(size).astype(np.float32),
        },
        {"steps": 120, "round": 120, "rounds_per_s": 30.0},
    )


def _fetch(peer: PeerNetwork, sources: list[str], **options: Any) -> tuple[Snapshot, Any]:
    return fetch_state(
        peer, sources, **{"timeout": 10, "max_bytes": 1 << 20, "chunk_bytes": CHUNK_BYTES, **options}
    )


def test_a_state_crosses_in_many_chunks_and_arrives_whole_with_each_chunk_sent_once() -> None:
    network = MemoryNetwork()
    source, newcomer = Lossy(network.join("source")), network.join("newcomer")
    state = _state()
    with serving(source, state):  # 8000 bytes: 25 chunks of 320
        received, stats = _fetch(newcomer, ["source"], window=4)
    for name, array in state.tensors.items():
        np.testing.assert_array_equal(received.tensors[name], array)
    assert received.counters == state.counters
    assert set(source.sent) == set(range(25)) and set(source.sent.values()) == {1}
    assert stats.bytes == 8000 and stats.chunks == {"source": 25} and stats.reasked == 0


def test_a_source_sends_no_more_than_its_window_beyond_what_the_requester_settled() -> None:
    """A requester that asks for everything at once (as the first version of this protocol
    answered) gets ``MAX_WINDOW`` chunks, and more only as it says it has settled them."""
    network = MemoryNetwork()
    source, asker = network.join("source"), network.join("asker")
    server = StateServer(source, _state(size=100_000))
    asker.send("source", REQUEST, 0, meta={"transfer": 1, "chunks": [0], "chunk_bytes": 1024, "settled": 0})
    server.serve()
    answer = asker.recv(1, (MANIFEST, CHUNK))
    assert answer is not None and answer.kind == MANIFEST and server.chunks_sent == 0  # a manifest first
    for first in range(0, 4 * MAX_WINDOW, MAX_WINDOW):
        chunks = list(range(first, first + MAX_WINDOW))
        asker.send(
            "source", REQUEST, 0, meta={"transfer": 1, "chunk_bytes": 1024, "chunks": chunks, "settled": 0}
        )
    server.serve()
    assert server.chunks_sent == MAX_WINDOW and server.refused["beyond_window"] == 3
    settled = {"transfer": 1, "chunk_bytes": 1024, "chunks": [200, 201], "settled": 10}
    asker.send("source", REQUEST, 0, meta=settled)
    server.serve()
    assert server.chunks_sent == MAX_WINDOW + 2


def test_chunks_lost_on_the_way_are_asked_again_not_the_whole_state() -> None:
    """The source's first answer to chunks 5 and 17 is lost: only those two are sent twice."""
    network = MemoryNetwork()
    lost: set[int] = set()

    def lose_once(index: int) -> bool:
        if index in (5, 17) and index not in lost:
            lost.add(index)
            return True
        return False

    source, newcomer = Lossy(network.join("source"), lose_once), network.join("newcomer")
    state = _state()
    with serving(source, state):
        received, stats = _fetch(newcomer, ["source"], window=4, retry_s=0.2)
    np.testing.assert_array_equal(received.tensors["params"], state.tensors["params"])
    assert sum(source.sent.values()) == 25 + 2 and source.sent[5] == source.sent[17] == 2
    assert stats.reasked >= 2


def test_several_sources_share_the_chunks_and_a_stalled_one_leaves_its_part_to_the_others() -> None:
    """Chunks come from both sources; "stalls" stops answering after 5 chunks: what it still
    owed comes from "steady", nothing already received is fetched again."""
    network = MemoryNetwork()
    stalls = Lossy(network.join("stalls"), lose=lambda _: sum(stalls.sent.values()) > 5)
    steady = Lossy(network.join("steady"))
    newcomer = network.join("newcomer")
    state = _state()
    with serving(stalls, state), serving(steady, state):
        received, stats = _fetch(newcomer, ["stalls", "steady"], window=4, retry_s=0.3)
    np.testing.assert_array_equal(
        received.tensors["optimizer.momentum_buffer"], state.tensors["optimizer.momentum_buffer"]
    )
    assert stats.chunks["stalls"] == 5 and stats.chunks["steady"] == 20
    assert stats.reasked > 0


class AfterEvent:
    """A state whose manifest is given only once ``event`` is set."""

    def __init__(self, state: Snapshot, event: threading.Event) -> None:
        self.state, self.event = state, event

    def manifest(self) -> Any:
        assert self.event.wait(HANG_S)
        return self.state.manifest()

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.state.read(start, stop)


def test_a_source_that_answers_first_takes_only_its_share_until_most_sources_have_answered() -> None:
    """Of three sources, two give their manifests only once "fast" has sent 13 chunks (of 25):
    it is asked for no more than its share (25 over the quorum of 2) meanwhile, so the chunks
    spread instead of all coming from the first to answer (as they did when the others were
    loaded members). Once the quorum has answered, each lane takes chunks as fast as it
    delivers them: how many more the fast one takes is a race (4-8 seen, more on a loaded
    machine), not a bound."""
    network = MemoryNetwork()
    fast = Lossy(network.join("fast"))
    slow = [network.join(f"slow-{i}") for i in range(2)]
    newcomer = network.join("newcomer")
    state = _state()
    shared = threading.Event()
    released: list[int] = []  # what "fast" had sent when the others answered

    def release() -> None:
        if not shared.is_set() and (sent := sum(fast.sent.values())) >= 13:
            released.append(sent)
            shared.set()

    with contextlib.ExitStack() as stack:
        stack.enter_context(serving(fast, state))
        for peer in slow:
            stack.enter_context(serving(peer, AfterEvent(state, shared)))
        stack.enter_context(in_background(release))
        received, stats = _fetch(newcomer, ["fast", *(peer.node_id for peer in slow)], window=4)
    np.testing.assert_array_equal(received.tensors["params"], state.tensors["params"])
    assert released == [13]  # held to its share until the quorum answered
    assert stats.chunks["fast"] >= 13 and len(stats.chunks) >= 2, stats.chunks  # ...and spread
    assert sum(stats.chunks.values()) == 25, stats.chunks


def test_a_source_whose_layout_differs_from_the_first_manifest_is_not_used() -> None:
    network = MemoryNetwork()
    good, other, newcomer = network.join("good"), network.join("other"), network.join("newcomer")
    state, answered = _state(), threading.Event()
    good_server, other_server = (
        StateServer(good, state),
        StateServer(other, AfterEvent(_state(size=999), answered)),
    )
    with in_background(lambda: good_server.serve() and answered.set()), in_background(other_server.serve):
        received, stats = _fetch(newcomer, ["good", "other"])
    np.testing.assert_array_equal(received.tensors["params"], state.tensors["params"])
    assert stats.chunks.keys() == {"good"}
    assert stats.dropped_sources == {"other": "its layout differs from good's"}


@pytest.mark.parametrize(
    ("tensors", "max_bytes", "why"),
    [
        ({"params": np.array([1.0, np.inf], np.float32)}, 1 << 20, "params has NaN or infinite values"),
        ({"params": np.zeros(100, np.float64)}, 500, "total size 800 is not in 0..500"),
        ({"params": np.zeros(4, np.complex64)}, 1 << 20, "bad layout entry"),
    ],
)
def test_bad_state_is_refused_before_it_is_used(
    tensors: dict[str, np.ndarray], max_bytes: int, why: str
) -> None:
    network = MemoryNetwork()
    server, newcomer = network.join("server"), network.join("newcomer")
    with serving(server, Snapshot(tensors, {"round": 1})), pytest.raises(StateTransferError, match=why):
        _fetch(newcomer, ["server"], max_bytes=max_bytes, timeout=HANG_S)


def test_a_wrong_version_is_refused() -> None:
    network = MemoryNetwork()
    server, newcomer = network.join("server"), network.join("newcomer")

    def answer_in_a_future_format() -> None:
        request = server.recv(HANG_S, (REQUEST,))
        assert request is not None
        meta = {**request.meta, "version": STATE_VERSION + 1}
        server.send("newcomer", MANIFEST, 0, meta=meta)

    thread = threading.Thread(target=answer_in_a_future_format)
    thread.start()
    with pytest.raises(
        StateTransferError, match=f"server: version {STATE_VERSION + 1}, this node reads {STATE_VERSION}"
    ):
        fetch_state(newcomer, ["server"], timeout=HANG_S, max_bytes=1 << 20)
    thread.join()


def test_fetch_from_a_silent_member_times_out_clearly() -> None:
    network = MemoryNetwork()
    network.join("silent")
    newcomer = network.join("newcomer")
    with pytest.raises(StateTransferError, match=re.escape("state from silent: nothing within 0.2 s")):
        fetch_state(newcomer, ["silent"], timeout=0.2, max_bytes=1 << 20)


def _adams(peers: Sequence[PeerNetwork], dtype: torch.dtype = torch.float32) -> list[GossipOptimizer]:
    """Equal models (a newcomer's parameters are chunks of its sources'), AdamW on each."""
    optimizers = []
    for peer in peers:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).to(dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        optimizers.append(GossipOptimizer(optimizer, peer=peer, topology=Topology("ring")))
    return optimizers


def test_a_live_state_reads_any_byte_range_as_the_whole_state_has_it() -> None:
    network = MemoryNetwork()
    (optimizer,) = _adams([network.join("me")], torch.bfloat16)
    model_params = optimizer.param_groups[0]["params"]
    sum(p.float().sum() for p in model_params).backward()
    optimizer.optimizer.step()  # Adam's moments (bfloat16) and its step counters
    state = optimizer.snapshot()
    assert set(state.tensors) == {"params", "optimizer.exp_avg", "optimizer.exp_avg_sq", "scalar.step"}
    np.testing.assert_array_equal(state.tensors["scalar.step"], [1.0] * 4)
    stream = state.read(0, sum(e.span for e in state.manifest()[0]))  # (aligned as served)
    rng = np.random.default_rng(0)
    for _ in range(50):
        start, stop = sorted(rng.integers(0, stream.size + 1, 2))
        np.testing.assert_array_equal(optimizer._state.read(start, stop), stream[start:stop])


def test_a_newcomer_takes_the_model_optimizer_and_counters_of_members_and_trains_on() -> None:
    with started_peers(["old", "older", "new"]) as peers:
        optimizers = _adams(peers)
        for optimizer in optimizers[:2]:
            params = optimizer.param_groups[0]["params"]
            sum(p.sum() for p in params).backward()
            optimizer.optimizer.step()  # Adam's moments
            optimizer.step_count = 50
        new_params, old_params = (
            optimizers[2].param_groups[0]["params"],
            optimizers[0].param_groups[0]["params"],
        )
        for new, old in zip(new_params, old_params, strict=True):
            assert not torch.equal(new, old)  # (before the transfer)
        with in_background(optimizers[0].serve_state), in_background(optimizers[1].serve_state):
            first_round = optimizers[2].join_from(["old", "older"], timeout=HANG_S)
        for new, old in zip(new_params, old_params, strict=True):
            torch.testing.assert_close(new, old)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(optimizers[2].state[new][key], optimizers[0].state[old][key])
        assert optimizers[2].step_count == 50
        assert first_round >= 2 and optimizers[2].round == first_round
        # the announcement travels on the network thread: under load it may take a moment
        assert wait_until(lambda: "new" not in peers[0].members(first_round - 1))
        sum(p.sum() for p in new_params).backward()
        optimizers[2].optimizer.step()  # Adam goes on from the moments (and step count) it took
        for optimizer in optimizers:
            optimizer.close()


def test_a_snapshot_that_does_not_fit_the_model_is_refused() -> None:
    network = MemoryNetwork()
    optimizer = GossipOptimizer(
        torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1), peer=network.join("me")
    )
    with pytest.raises(
        StateTransferError, match=r"snapshot params is float32\[5\]; this model needs float32\[8\]"
    ):
        optimizer.restore(Snapshot({"params": np.zeros(5, np.float32)}, {}))
    with pytest.raises(StateTransferError, match="unknown snapshot tensor 'weights'"):
        optimizer.restore(
            Snapshot({"params": np.zeros(8, np.float32), "weights": np.zeros(8, np.float32)}, {})
        )


def test_a_source_with_bad_values_is_left_out_and_its_part_fetched_from_another() -> None:
    """Each chunk is checked as it comes, so a bad one is pinned on its source: "bad" holds an
    infinite value in every chunk from its 4th on (which chunks a source is asked for depends
    on whose manifest came first), the state comes whole from "good" and "bad"'s good chunks."""
    network = MemoryNetwork()
    bad, good, newcomer = network.join("bad"), network.join("good"), network.join("newcomer")
    state = _state()
    broken = {name: array.copy() for name, array in state.tensors.items()}
    per_chunk = CHUNK_BYTES // 4  # (values of the float32 arrays, the one after the other)
    broken["params"][3 * per_chunk :: per_chunk] = np.inf
    broken["optimizer.momentum_buffer"][::per_chunk] = np.inf
    with serving(bad, Snapshot(broken, state.counters)), serving(good, state):
        received, stats = _fetch(newcomer, ["bad", "good"], window=4)
    np.testing.assert_array_equal(received.tensors["params"], state.tensors["params"])
    assert stats.dropped_sources.keys() == {"bad"}
    assert re.fullmatch(r"params has NaN or infinite values \(chunk (\d+)\)", stats.dropped_sources["bad"])
    assert stats.chunks["good"] >= 25 - stats.chunks.get("bad", 0) and stats.chunks.get("bad", 0) <= 3


def test_a_source_that_answers_nothing_more_is_left_after_its_patience() -> None:
    """It sent its manifest and then no chunk: re-asking it (every retry_s) does not keep it."""
    network = MemoryNetwork()
    mute, newcomer = Lossy(network.join("mute"), lose=lambda _: True), network.join("newcomer")
    started = time.monotonic()
    with serving(mute, _state()), pytest.raises(StateTransferError, match=r"mute: silent for 1 s"):
        _fetch(newcomer, ["mute"], retry_s=0.2, patience_s=1.0)
    assert time.monotonic() - started < 10  # not the 10 s timeout


def test_a_requester_that_asks_slowly_is_served_without_a_new_manifest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slow link: requests further apart than the source's RETRY_S still get chunks."""
    monkeypatch.setattr(gossip.state.server, "RETRY_S", 0.05)
    network = MemoryNetwork()
    source, asker = network.join("source"), network.join("asker")
    server = StateServer(source, _state())
    asker.send("source", REQUEST, 0, meta={"transfer": 1, "manifest": True})
    server.serve()
    time.sleep(0.1)  # (twice the source's RETRY_S)
    asker.send("source", REQUEST, 0, meta={"transfer": 1, "chunks": [0], "chunk_bytes": 1024, "settled": 0})
    server.serve()
    kinds = [message.kind for message in iter(lambda: asker.recv(0.5, (MANIFEST, CHUNK)), None)]
    assert kinds == [MANIFEST, CHUNK] and server.chunks_sent == 1
