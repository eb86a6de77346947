"""The averaging math over real peers: exact average, renormalisation, the optimizer wrapper."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import average_in_threads, run_together, started_peers

from gossip import Codec, FlatParameters, GossipOptimizer, IncompatibleOptionsError, consensus_distance
from gossipmesh.sim.memory import MemoryNetwork
from topologies import Topology

ROUNDS = {"ring": 120, "exponential": 40, "complete": 3, "one-peer-exponential": 3}


@pytest.mark.parametrize("topology", ROUNDS)
def test_pure_averaging_reaches_the_exact_average(topology: str) -> None:
    n = 8
    rng = np.random.default_rng(42)
    vectors = [rng.standard_normal(1000) + 3.0 for _ in range(n)]
    target = np.mean(vectors, axis=0)
    with started_peers([f"node-{i}" for i in range(n)]) as peers:
        # exact only when no round times out: the bound is generous for a busy machine
        average_in_threads(peers, vectors, topology=topology, rounds=ROUNDS[topology], timeout=60)
    for vector in vectors:
        np.testing.assert_allclose(vector, target, atol=1e-6, rtol=0)
    assert consensus_distance(vectors) < 1e-7


def test_the_mean_is_preserved_every_round() -> None:
    rng = np.random.default_rng(7)
    vectors = [rng.standard_normal(50) for _ in range(5)]
    target = np.mean(vectors, axis=0)
    with started_peers([f"n{i}" for i in range(5)]) as peers:
        for _ in range(4):
            average_in_threads(peers, vectors, topology="ring", rounds=1)
            np.testing.assert_allclose(np.mean(vectors, axis=0), target, atol=1e-12)
    assert consensus_distance(vectors) > 1e-3  # 4 ring rounds do not reach consensus yet


def test_consensus_distance_definition() -> None:
    vectors = [np.array([1.0, 0.0]), np.array([3.0, 0.0])]  # mean (2, 0); each is 1 away
    assert consensus_distance(vectors) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="mean vector is zero"):
        consensus_distance([np.array([1.0]), np.array([-1.0])])


def test_flat_parameters_are_views_the_optimizer_still_updates() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    flat = FlatParameters(model.parameters())
    assert flat.array.size == sum(p.numel() for p in before)
    for param, old in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(param.detach(), old)
    flat.array[:] = 1.0  # writing the buffer changes the model
    assert all(bool((p == 1.0).all()) for p in model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # and a step on the parameters changes the buffer
    assert (flat.array != 1.0).any()


def test_gossip_optimizer_steps_locally_then_averages() -> None:
    with started_peers(["a", "b"]) as (a, b):
        models = [torch.nn.Linear(2, 1, bias=False) for _ in range(2)]
        with torch.no_grad():
            models[0].weight.fill_(1.0)
            models[1].weight.fill_(3.0)
        optimizers = [
            GossipOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), peer=p, topology=Topology("ring"))
            for m, p in zip(models, (a, b), strict=True)
        ]
        run_together(o.step for o in optimizers)
    for model in models:
        torch.testing.assert_close(model.weight.detach(), torch.full((1, 2), 2.0))
    assert all(o.last_round is not None and o.last_round.arrived == 1 for o in optimizers)


def test_gossip_optimizer_refuses_what_its_algorithm_cannot_do() -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(IncompatibleOptionsError, match="compression=int8 needs algorithm=choco"):
        GossipOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            peer=MemoryNetwork().join("solo"),
            compression=Codec.parse("int8"),
        )
