"""What a simulation runs on: node count, compute times, links, faults. Seeded, so reproducible."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gossipmesh.sim.links import Link, Partition

STEP_STREAM, STRAGGLER_STREAM, CRASH_STREAM = 2, 3, 4  # seed streams (the network's loss draws use 1)


def node_id(index: int) -> str:
    """Simulated node ``index``'s id: ``node-0``, ``node-1``... (joiners continue the count)."""
    return f"node-{index}"


@dataclass(frozen=True)
class Stragglers:
    """A ``fraction`` of the nodes (drawn with the seed) whose steps take ``factor`` times longer."""

    fraction: float = 0.0
    factor: float = 1.0

    def __str__(self) -> str:
        return f"{self.fraction:g}:{self.factor:g}"


@dataclass(frozen=True)
class Compute:
    """How long a node's local steps take: ``step_s`` times the node's straggler factor, times a
    lognormal jitter of shape ``jitter`` drawn per step (0: every step the same)."""

    step_s: float = 0.0
    jitter: float = 0.0
    stragglers: Stragglers = Stragglers()

    def step_times(self, nodes: int, steps: int, seed: int) -> np.ndarray:
        """Step durations of nodes 0..nodes-1, shape (nodes, steps); node i's row depends only on
        (seed, i) and whether it straggles, so a node that joins later draws its own."""
        slow = np.random.default_rng([seed, STRAGGLER_STREAM]).permutation(nodes)
        factors = np.ones(nodes)
        factors[slow[: round(self.stragglers.fraction * nodes)]] = self.stragglers.factor
        times = np.empty((nodes, steps))
        for node in range(nodes):
            rng = np.random.default_rng([seed, STEP_STREAM, node])
            jitter = rng.lognormal(0.0, self.jitter, steps) if self.jitter else np.ones(steps)
            times[node] = self.step_s * factors[node] * jitter
        return times


@dataclass(frozen=True)
class Crash:
    """Node ``node`` (its index) stops at ``at_s``."""

    node: int
    at_s: float


def crash_waves(waves: Sequence[tuple[float, float]], nodes: int, seed: int) -> tuple[Crash, ...]:
    """For each (fraction, at_s): that fraction of the ``nodes`` starting nodes crash at ``at_s``;
    the nodes are drawn with the seed, and no node crashes twice."""
    order = np.random.default_rng([seed, CRASH_STREAM]).permutation(nodes)
    crashes: list[Crash] = []
    for fraction, at_s in waves:
        count = round(fraction * nodes)
        crashes += [Crash(int(node), at_s) for node in order[len(crashes) : len(crashes) + count]]
    return tuple(crashes)


def split_in_halves(start_s: float, end_s: float, nodes: int) -> Partition:
    """From ``start_s`` to ``end_s``, nodes ``0 .. nodes/2 - 1`` on one side, the rest (joiners
    included) on the other."""
    return Partition(start_s, end_s, frozenset(node_id(i) for i in range(nodes // 2)))


@dataclass(frozen=True)
class Scenario:
    """Args:
    nodes: the nodes at the start (``node_id``: ``node-0`` ... ``node-{nodes-1}``).
    rounds: local steps per node (one gossip round each for the synchronous algorithms).
    compute: step times.
    link: every link's latency and bandwidth, unless ``links`` names the (sender, receiver) pair.
    loss: the probability that a message is lost.
    model_bytes: the size a model has on the wire; None: the averaged vectors' own size.
    crashes, joins, partitions: faults; ``joins`` are the times new nodes arrive (each takes
        a copy of a live node's model and starts ``JOIN_AHEAD_ROUNDS`` rounds ahead of the mesh).
    detect_s: how long the others take to drop a crashed node from the membership.
    round_timeout: the algorithms' longest wait for a neighbour, in virtual seconds.
    seed: seeds the start vectors, step times, stragglers and losses.
    """

    nodes: int
    rounds: int
    compute: Compute = Compute()
    link: Link = Link()
    links: Mapping[tuple[str, str], Link] = field(default_factory=dict)
    loss: float = 0.0
    model_bytes: int | None = None
    crashes: Sequence[Crash] = ()
    joins: Sequence[float] = ()
    partitions: Sequence[Partition] = ()
    detect_s: float = 1.0
    round_timeout: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.rounds < 1:
            raise ValueError(
                f"a simulation needs nodes >= 1 and rounds >= 1, got {self.nodes}, {self.rounds}"
            )
