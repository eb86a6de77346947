"""The library API: a user's own model and loop, averaged through GossipOptimizer."""

from __future__ import annotations

import json
import multiprocessing
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import HANG_S, addresses, run_example, run_together

from gossip import GossipOptimizer, consensus_distance
from gossip.algorithms.registry import AUTO_LOCAL_STEPS
from gossip.phases import PHASES
from gossipmesh.sim.memory import MemoryNetwork
from p2p.security.curve import keygen
from topologies import Topology

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sine_regression.py"


@pytest.mark.mesh
def test_wrapper_trains_a_user_defined_model_in_a_multiprocess_mesh(
    tmp_path: Path, no_other_threads: None
) -> None:
    # forked, as the mesh launcher forks its nodes: three fresh interpreters would spend more
    # time importing torch than training
    fork = multiprocessing.get_context("fork")
    listen = addresses(3)
    keys = tmp_path / "keys"
    keygen(keys, "mesh")  # one CURVE pair for the mesh: each node's own key and the trusted one
    processes = []
    for rank, address in enumerate(listen):
        argv = ["--listen", address, "--expect", "3", "--steps", "150", "--threads", "1",
                "--keys", str(keys), "--trusted", str(keys),
                "--save-params", str(tmp_path / f"{rank}.npy"),
                *(["--bootstrap", listen[0]] if rank else [])]  # fmt: skip
        processes.append(fork.Process(target=run_example, args=(EXAMPLE, argv, tmp_path / f"{rank}.json")))
        processes[-1].start()
    for process in processes:
        process.join(timeout=HANG_S)
        assert process.exitcode == 0
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(3)]
    assert sorted(r["rank"] for r in results) == [0, 1, 2]
    for result in results:
        assert result["rounds"] == 150 // AUTO_LOCAL_STEPS  # (the default: a round every 10 steps)
        assert result["loss_after"] < 0.1 * result["loss_before"], result  # MSE 0.65 -> < 0.065
        assert set(result["seconds"]) == set(PHASES) and result["seconds"]["compute"] > 0
    params = [np.load(tmp_path / f"{rank}.npy") for rank in range(3)]
    assert consensus_distance(params) < 0.01  # trained on different shards, kept together


def test_phase_timer_puts_a_straggler_into_its_neighbours_wait() -> None:
    network = MemoryNetwork()
    peers = [network.join(name) for name in ("fast", "slow")]
    optimizers: dict[str, GossipOptimizer] = {}
    steps, straggle_s = 12, 0.02

    def train(peer_index: int) -> None:
        peer = peers[peer_index]
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        optimizer = GossipOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), peer=peer, topology=Topology("complete")
        )
        optimizers[peer.node_id] = optimizer
        for step in range(steps):
            if peer.node_id == "slow":
                time.sleep(straggle_s)
            inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + 100 * peer_index))
            optimizer.zero_grad()
            model(inputs).pow(2).mean().backward()
            optimizer.step()
        optimizer.close()

    run_together(partial(train, i) for i in range(2))
    fast, slow = optimizers["fast"], optimizers["slow"]
    assert set(fast.phases.totals) == set(PHASES) and set(fast.phases.last) == set(PHASES)
    # after its first round the fast node waits for each of the slow one's straggling steps
    assert fast.phases.totals["wait"] >= 0.5 * (steps - 1) * straggle_s
    assert slow.phases.totals["compute"] >= (steps - 1) * straggle_s
    assert fast.phases.totals["wait"] > 3 * slow.phases.totals["wait"]
    assert all(seconds >= 0 for seconds in fast.phases.totals.values())
    # the two models differed after every local step (different data): the estimate saw it
    assert fast.consensus_estimate is not None and fast.consensus_estimate > 0
