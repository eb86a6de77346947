"""What gossip costs at 64 to 4,096 nodes, simulated with the real algorithm code (``sim``).

Two tables, printed as markdown (the README's):

1. Pure averaging at 1,024 nodes on four topologies: measured contraction of the consensus
   distance per round against the spectral prediction, and how long the simulation took. The
   fixed graphs (exponential, ring) start in their slowest mode, whose contraction the prediction
   is; the schedules (one-peer exponential, random matching) from random vectors.
2. For N in {64, 256, 1024, 4096}: virtual time per epoch and bytes per node per epoch of each
   algorithm (on its default topology) against ring allreduce, homogeneous and with 5% of the
   nodes 4x slower. An epoch is ImageNet's 1,281,167 examples at 32 per node per step; the
   table simulates up to ``MAX_ROUNDS`` steps per node and scales the mesh's measured throughput
   (steps of all nodes per virtual second, ``SimResult.steps_per_s``: fast nodes of an
   asynchronous algorithm do more steps than a straggler) and the bytes a node sends per step to
   an epoch.

    python bench/simulator.py [--sizes 64,256,1024,4096] [--latency-ms 0.1] [--gbps 10]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from gossip import Algorithm, Codec
from gossipmesh.sim.allreduce import ring_allreduce
from gossipmesh.sim.links import Link
from gossipmesh.sim.run import averaging, simulate, slowest_mode_vectors, start_vectors
from gossipmesh.sim.scenario import Compute, Scenario, Stragglers
from topologies import Topology, second_eigenvalue_modulus

EXAMPLES, BATCH = 1_281_167, 32
MODEL_BYTES, STEP_S = 100_000_000, 0.1  # about ResNet-50 in float32, one GPU step
MAX_ROUNDS = 20
ALGORITHMS = ("dpsgd", "sgp", "adpsgd")
CONTRACTION = (("exponential", 6), ("one-peer-exponential", 10), ("ring", 6), ("random-matching", 16))


def contraction_table(link: Link) -> None:
    n = 1024
    print(f"| topology (N = {n}) | start | rounds | measured contraction | predicted | simulation took |")
    print("|---|---|---|---|---|---|")
    for name, rounds in CONTRACTION:
        topology = Topology.parse(name)
        expected = topology.family.expected_contraction
        period = topology.period(n) or 1
        predicted = (
            expected(n) if expected else second_eigenvalue_modulus(_product(topology, n)) ** (1 / period)
        )
        fixed = not topology.family.time_varying
        vectors = slowest_mode_vectors(topology.weights(n), 0) if fixed else start_vectors(n, 0)
        build = averaging(vectors, Algorithm.parse("dpsgd"), topology, 2.0, Codec())
        result = simulate(Scenario(nodes=n, rounds=rounds, link=link), build, vectors[0].nbytes)
        distances = [p.consensus_distance for p in result.rounds]
        if predicted < 1e-9:
            measured = f"exact after {next(r + 1 for r, d in enumerate(distances) if d < 1e-12)} rounds"
        else:
            first = rounds // 2
            measured = f"{(distances[-1] / distances[first]) ** (1 / (rounds - 1 - first)):.7f}"
        start = "slowest mode" if fixed else "random"
        print(f"| {name} | {start} | {rounds} | {measured} | {predicted:.7f} | {result.sim_seconds:.1f} s |")


def _product(topology: Topology, n: int) -> np.ndarray:
    """The mixing matrix of one period of the schedule."""
    product = np.eye(n)
    for r in range(topology.period(n) or 1):
        product = topology.weights(n, r) @ product
    return product


def epoch_table(sizes: list[int], link: Link) -> None:
    print("| N | arm | s/epoch | GB/node/epoch | s/epoch, 5% 4x slower | GB/node/epoch | simulation took |")
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        steps = math.ceil(EXAMPLES / (BATCH * n))
        rounds = min(steps, MAX_ROUNDS)
        for arm in (*ALGORITHMS, "allreduce"):
            cells, took = [], 0.0
            for stragglers in (Stragglers(), Stragglers(0.05, 4)):
                scenario = Scenario(
                    nodes=n,
                    rounds=rounds,
                    compute=Compute(STEP_S, stragglers=stragglers),
                    link=link,
                    model_bytes=MODEL_BYTES,
                )
                started = time.perf_counter()
                epoch_s, bytes_per_step = _arm(arm, scenario, steps)
                took += time.perf_counter() - started
                cells += [f"{epoch_s:.1f}", f"{bytes_per_step * steps / 1e9:.1f}"]
            print(f"| {n} | {arm} | {' | '.join(cells)} | {took:.1f} s |", flush=True)


def _arm(arm: str, scenario: Scenario, steps: int) -> tuple[float, float]:
    """(virtual seconds per epoch of ``steps`` steps per node, bytes a node sends per step)."""
    if arm == "allreduce":
        last = ring_allreduce(scenario, MODEL_BYTES)[-1]
        return last.virtual_time_s * steps / (last.round + 1), last.bytes_per_node / (last.round + 1)
    algorithm = Algorithm.parse(arm)
    vectors = start_vectors(scenario.nodes, scenario.seed)
    build = averaging(vectors, algorithm, algorithm.default_topology, 2.0, Codec())
    result = simulate(scenario, build, vectors[0].nbytes)
    last = result.rounds[-1]
    return steps * scenario.nodes / result.steps_per_s(), last.bytes_per_node / (last.round + 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="64,256,1024,4096")
    parser.add_argument("--latency-ms", type=float, default=0.1)
    parser.add_argument("--gbps", type=float, default=10.0)
    parser.add_argument("--skip-contraction", action="store_true")
    args = parser.parse_args()
    link = Link(args.latency_ms / 1000, args.gbps * 1e9 / 8)
    print(
        f"latency {args.latency_ms} ms, {args.gbps} Gbps links, {MODEL_BYTES / 1e6:.0f} MB model, "
        f"{STEP_S * 1000:.0f} ms steps\n"
    )
    if not args.skip_contraction:
        contraction_table(link)
        print()
    epoch_table([int(s) for s in args.sizes.split(",")], link)


if __name__ == "__main__":
    main()
