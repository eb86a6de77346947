"""Joining with state: chunked, versioned, validated snapshots between peers."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from helpers import in_background, started_peers, wait_until

from gossip import GossipOptimizer
from gossip.network import PeerNetwork
from gossip.state import (
    STATE_VERSION,
    Snapshot,
    StateServer,
    StateTransferError,
    fetch_snapshot,
    send_snapshot,
)
from gossipmesh.sim.memory import MemoryNetwork
from topologies import Topology

CHUNK = 300


@contextmanager
def serving(
    peer: PeerNetwork, take_snapshot: Callable[[], Snapshot], chunk_bytes: int = CHUNK
) -> Iterator[None]:
    """Answer state requests on a thread, as a training loop does between its steps."""
    with in_background(StateServer(peer, take_snapshot, chunk_bytes).serve):
        yield


def test_a_snapshot_crosses_in_many_chunks_and_arrives_whole() -> None:
    network = MemoryNetwork()
    server, newcomer = network.join("server"), network.join("newcomer")
    snapshot = Snapshot(
        {"params": np.arange(1000, dtype=np.float32), "optimizer.momentum_buffer": np.ones(1000, np.float32)},
        {"local_steps": 120, "round": 120, "rounds_per_s": 30.0},
    )
    with serving(server, lambda: snapshot):  # 8000 bytes: 27 chunks of at most 300
        received = fetch_snapshot(newcomer, "server", timeout=5, max_bytes=1 << 20, chunk_bytes=CHUNK)
    np.testing.assert_array_equal(received.tensors["params"], snapshot.tensors["params"])
    np.testing.assert_array_equal(received.tensors["optimizer.momentum_buffer"], 1.0)
    assert received.counters == snapshot.counters


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
    with (
        serving(server, lambda: Snapshot(tensors, {"round": 1})),
        pytest.raises(StateTransferError, match=why),
    ):
        fetch_snapshot(newcomer, "server", timeout=5, max_bytes=max_bytes, chunk_bytes=CHUNK)


def test_a_wrong_version_is_refused() -> None:
    network = MemoryNetwork()
    server, newcomer = network.join("server"), network.join("newcomer")

    def answer_in_a_future_format() -> None:
        request = server.recv(5, ("state_request",))
        assert request is not None
        meta = {"transfer": request.meta["transfer"], "index": 0, "count": 1, "version": STATE_VERSION + 1}
        server.send("newcomer", "state_chunk", 0, [np.zeros(4, np.uint8)], meta)

    thread = threading.Thread(target=answer_in_a_future_format)
    thread.start()
    with pytest.raises(
        StateTransferError, match=f"version {STATE_VERSION + 1}, this node reads {STATE_VERSION}"
    ):
        fetch_snapshot(newcomer, "server", timeout=5, max_bytes=1 << 20)
    thread.join()


def test_a_lost_request_is_asked_again_and_a_stale_answer_ignored() -> None:
    """The source misses the first request (its answer is lost on the way, say); the newcomer
    asks again and takes only the answer to its newest request, even when the first one's
    chunks turn up late."""
    network = MemoryNetwork()
    server, newcomer = network.join("server"), network.join("newcomer")
    params = np.arange(1000, dtype=np.float32)
    requests = []

    def lose_the_first_answer_then_serve() -> None:
        first = server.recv(5, ("state_request",))
        assert first is not None
        requests.append(first.meta["transfer"])
        second = server.recv(5, ("state_request",))
        assert second is not None
        requests.append(second.meta["transfer"])
        late = Snapshot({"params": np.zeros(1000, np.float32)}, {"round": 1})
        send_snapshot(server, "newcomer", first.meta["transfer"], late, CHUNK)  # the lost one, late
        send_snapshot(server, "newcomer", second.meta["transfer"], Snapshot({"params": params}, {}), CHUNK)

    thread = threading.Thread(target=lose_the_first_answer_then_serve)
    thread.start()
    snapshot = fetch_snapshot(
        newcomer, "server", timeout=5, max_bytes=1 << 20, chunk_bytes=CHUNK, retry_s=0.2
    )
    thread.join()
    assert len(set(requests)) == 2
    np.testing.assert_array_equal(snapshot.tensors["params"], params)


def test_fetch_from_a_silent_member_times_out_clearly() -> None:
    network = MemoryNetwork()
    network.join("silent")
    newcomer = network.join("newcomer")
    with pytest.raises(StateTransferError, match=re.escape("state from silent: nothing within 0.2 s")):
        fetch_snapshot(newcomer, "silent", timeout=0.2, max_bytes=1 << 20)


def test_a_newcomer_takes_the_model_optimizer_and_counters_of_a_member() -> None:
    with started_peers(["old", "new"]) as (old, new):
        torch.manual_seed(0)
        models = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]
        optimizers = [
            GossipOptimizer(
                torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), peer=p, topology=Topology("ring")
            )
            for m, p in zip(models, (old, new), strict=True)
        ]
        models[0](torch.ones(4, 3)).sum().backward()
        optimizers[0].optimizer.step()  # the old node has momentum buffers now
        optimizers[0].local_steps = 50
        with serving(old, optimizers[0].snapshot):
            first_round = optimizers[1].join_from("old", timeout=5)
        torch.testing.assert_close(models[1].weight, models[0].weight)
        torch.testing.assert_close(models[1].bias, models[0].bias)
        assert optimizers[1].local_steps == 50
        assert first_round >= 2 and optimizers[1].round == first_round
        old_momentum = optimizers[0].optimizer.state[models[0].weight]["momentum_buffer"]
        torch.testing.assert_close(
            optimizers[1].optimizer.state[models[1].weight]["momentum_buffer"], old_momentum
        )
        # the announcement travels on the network thread: under load it may take a moment
        assert wait_until(lambda: "new" not in old.members(first_round - 1), 10)


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
