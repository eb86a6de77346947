"""The reference arm: synchronous data parallelism with ring allreduce, as a time model.

Every step waits for the slowest node, then reduces: each node sends and receives 2(n-1)/n of the
model, in 2(n-1) steps that each pay the link latency (the usual latency-bandwidth model of ring
allreduce; Thakur et al. 2005). Every node then holds the same model: the consensus distance is 0.
The step times are the gossip arms' own draws (``Compute.step_times``), stragglers included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gossipmesh.sim.run import RoundPoint
from gossipmesh.sim.scenario import Scenario


@dataclass(frozen=True)
class RingAllreduce:
    """What ``gossipmesh simulate --algorithm allreduce`` runs instead of a gossip algorithm."""

    def __str__(self) -> str:
        return "allreduce"


def ring_allreduce(scenario: Scenario, model_bytes: int) -> list[RoundPoint]:
    n = scenario.nodes
    share = 2 * (n - 1) / n * model_bytes
    reduce_s = scenario.link.transfer_s(share) + 2 * (n - 1) * scenario.link.latency_s
    slowest = scenario.compute.step_times(n, scenario.rounds, scenario.seed).max(axis=0)
    finished = np.cumsum(slowest + reduce_s)
    return [
        RoundPoint(
            round=r, consensus_distance=0.0, virtual_time_s=float(t), bytes_per_node=share * (r + 1), nodes=n
        )
        for r, t in enumerate(finished)
    ]
