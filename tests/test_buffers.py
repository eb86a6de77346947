"""Floating-point buffers (BatchNorm's running statistics) are averaged with the parameters, as
DDP broadcasts them; integer and non-persistent buffers stay local; ``average_buffers=False``
keeps them all local."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from gossip import Algorithm, GossipOptimizer
from gossip.consensus import consensus_distance
from gossip.optim.optimizer import averaged_buffers
from gossipmesh.sim.links import VirtualPeer
from gossipmesh.sim.memory import MemoryNetwork
from gossipmesh.sim.run import simulate
from gossipmesh.sim.scenario import Compute, Scenario
from gossipmesh.sim.training import model_nbytes, training
from gossipmesh.tasks.digits import DigitsTask
from topologies import Topology

NODES, STEPS = 3, 150


class DigitsCNN(DigitsTask):
    """The digits task with a small CNN whose BatchNorm keeps running statistics."""

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(8 * 64, 10),
        )


def test_the_averaged_buffers_are_the_float_ones_of_the_state_dict() -> None:
    model = DigitsCNN().model(0)
    model.register_buffer("scale", torch.ones(3), persistent=False)  # derived: not state
    model.register_buffer("causal", torch.full((2, 2), -torch.inf).triu(1))  # a mask, not a statistic
    batch_norm = model[2]
    assert averaged_buffers(model) == [batch_norm.running_mean, batch_norm.running_var]


def test_a_joiner_takes_the_buffers_with_the_parameters() -> None:
    network = MemoryNetwork()
    task = DigitsCNN()
    models = [task.model(seed) for seed in (0, 1)]
    models[0][2].running_mean.fill_(0.25)
    source, joiner = (
        GossipOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), peer=network.join(name), model=m)
        for m, name in zip(models, ("source", "joiner"), strict=True)
    )
    joiner.restore(source.snapshot())
    torch.testing.assert_close(models[1][2].running_mean, torch.full((8,), 0.25))
    torch.testing.assert_close(models[1][1].weight, models[0][1].weight)


def _mesh(average_buffers: bool) -> tuple[list[nn.Module], DigitsCNN]:
    """Three D-PSGD nodes of the CNN after STEPS steps each, in the simulator (the same every run)."""
    task = DigitsCNN()
    models: list[nn.Module] = []

    def optimizer(model: nn.Module, peer: VirtualPeer) -> GossipOptimizer:
        models.append(model)
        return GossipOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            peer=peer,
            algorithm=Algorithm.parse("dpsgd"),
            topology=Topology.parse("ring"),
            model=model,
            average_buffers=average_buffers,
        )

    scenario = Scenario(nodes=NODES, rounds=STEPS, compute=Compute(step_s=0.02))
    simulate(scenario, training(task, NODES, optimizer, batch_size=32, seed=0), model_nbytes(task, 0))
    return models, task


def _vectors(models: list[nn.Module], tensors: str) -> list[np.ndarray]:
    pick = (lambda m: list(m.parameters())) if tensors == "params" else averaged_buffers
    return [torch.cat([t.detach().reshape(-1) for t in pick(m)]).numpy() for m in models]


@pytest.fixture(scope="module")
def averaged() -> tuple[list[nn.Module], DigitsCNN]:
    return _mesh(average_buffers=True)


def test_the_buffers_agree_as_the_parameters_do(averaged: tuple[list[nn.Module], DigitsCNN]) -> None:
    models, _ = averaged
    params, buffers = (
        consensus_distance(_vectors(models, "params")),
        consensus_distance(_vectors(models, "buffers")),
    )
    local, _ = _mesh(average_buffers=False)
    kept_local = consensus_distance(_vectors(local, "buffers"))
    print(
        f"consensus distance: parameters {params:.2e}, buffers {buffers:.2e}, "
        f"buffers kept local {kept_local:.2e}"
    )
    assert buffers <= 2 * params + 1e-6  # mixed every round as the parameters are
    assert kept_local >= 10 * buffers  # each node's own batches' statistics


def test_every_node_scores_as_the_average_model_does(averaged: tuple[list[nn.Module], DigitsCNN]) -> None:
    models, task = averaged
    average = task.model(0)
    for name, tensor in average.state_dict().items():
        if tensor.is_floating_point():
            tensor.copy_(torch.stack([m.state_dict()[name] for m in models]).mean(dim=0))
    expected = task.evaluate(average).accuracy
    accuracies = [task.evaluate(m).accuracy for m in models]
    print(f"average model {expected:.3f}, nodes {accuracies}")
    assert expected > 0.85
    assert all(abs(a - expected) <= 0.01 for a in accuracies), (accuracies, expected)
