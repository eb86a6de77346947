"""``gossipmesh simulate``: a mesh of N nodes running the real averaging code in virtual time.

Pure averaging (``--model-size``, the default) starts every node from a random vector and
charges each message as if it carried a model of that size; ``--task`` trains the task's real
model on every node (small N). ``--algorithm allreduce`` is the ring-allreduce time model.
Faults (``--crash``, ``--join``, ``--partition``) happen at given virtual times, in seconds
from the start; each flag can be given several times. ``--link`` sets nodes' uplinks apart from
``--bandwidth``, as ``gossipmesh mesh --hosts netns --link`` caps them.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from gossipmesh.config import SimulateConfig
from gossipmesh.config.values import uplink_mbps
from gossipmesh.sim.allreduce import RingAllreduce, ring_allreduce
from gossipmesh.sim.links import Link, VirtualPeer
from gossipmesh.sim.run import RoundPoint, SimResult, simulate, start_vectors
from gossipmesh.sim.scenario import Compute, Scenario, Stragglers, crash_waves, node_id, split_in_halves

if TYPE_CHECKING:
    import torch

    from gossip import GossipOptimizer

PROGRESS_EVERY_S = 2.0  # a long simulation says how far it is on stderr, this often
TABLE_ROWS = 20  # rounds shown in the table (evenly spaced, the last one always)
DEFAULT_MODEL_BYTES = 100_000_000  # about ResNet-50 in float32


def run(config: SimulateConfig, out: TextIO | None = None) -> int:
    """Simulate ``config``'s mesh and print its table (or JSON) to ``out`` (default: stdout)."""
    out = out or sys.stdout
    scenario = _scenario(config)
    if isinstance(config.algorithm, RingAllreduce):
        result = SimResult(
            ring_allreduce(scenario, scenario.model_bytes or DEFAULT_MODEL_BYTES), 0.0, {}, 0, {}
        )
    else:
        result = _gossip(config, scenario)
    if config.json:
        print(json.dumps(result.as_json()), file=out)
    else:
        _table(result, config, out)
    _warn_after_the_end(scenario, result.rounds[-1].virtual_time_s)
    return 0


def _scenario(config: SimulateConfig) -> Scenario:
    joins = [join.at for join in config.join for _ in range(join.count)]
    return Scenario(
        nodes=config.nodes,
        rounds=config.rounds,
        compute=Compute(config.compute_ms / 1000, config.jitter, config.straggler or Stragglers()),
        link=_uplink(config, None),
        links={
            (node_id(cap.rank), node_id(other)): _uplink(config, cap.rank)
            for cap in config.link
            if cap.rank is not None
            for other in range(config.nodes + len(joins))
            if other != cap.rank
        },
        loss=config.loss,
        model_bytes=None if config.task else (config.model_size or DEFAULT_MODEL_BYTES),
        crashes=crash_waves(config.crash, config.nodes, config.seed),
        joins=joins,
        partitions=[split_in_halves(cut.start_s, cut.end_s, config.nodes) for cut in config.partition],
        round_timeout=config.round_timeout,
        seed=config.seed,
    )


def _uplink(config: SimulateConfig, rank: int | None) -> Link:
    """The link out of node ``rank`` (None: out of the nodes no ``--link RANK:MBPS`` names):
    its ``--link``, else ``--bandwidth``."""
    mbps = uplink_mbps(config.link, rank)
    bytes_per_s = config.bandwidth * 1e9 / 8 if mbps is None else mbps * 1e6 / 8
    return Link(config.latency / 1000, bytes_per_s)


def _warn_after_the_end(scenario: Scenario, end_s: float) -> None:
    """Faults the run ended before did not happen: say so, and how to reach them."""
    late = [
        *(f"--crash at {crash.at_s:g} s" for crash in scenario.crashes if crash.at_s >= end_s),
        *(f"--join at {at_s:g} s" for at_s in scenario.joins if at_s >= end_s),
        *(f"--partition at {cut.start_s:g} s" for cut in scenario.partitions if cut.start_s >= end_s),
    ]
    if late:
        print(
            f"gossipmesh: warning: the run ended at {end_s:.3g} virtual s, before "
            f"{', '.join(dict.fromkeys(late))}; raise --rounds to simulate that far",
            file=sys.stderr,
        )


def _gossip(config: SimulateConfig, scenario: Scenario) -> SimResult:
    """Every node's optimizer made as a daemon makes its own (``Averaging.gossip_optimizer``)."""
    # (torch: imported once a simulation runs, not for --help, which shows this module's doc)
    from gossipmesh.sim.training import averaging_through, model_nbytes, training

    def optimizer(model: torch.nn.Module, peer: VirtualPeer) -> GossipOptimizer:
        return config.gossip_optimizer(config.local_optimizer(model), peer, model=model)

    if config.task is not None:
        task = config.task.make()
        build = training(task, config.nodes, optimizer, batch_size=config.batch_size, seed=config.seed)
        return simulate(scenario, build, model_nbytes(task, config.seed), _progress(config.rounds))
    vectors = start_vectors(config.nodes, config.seed)
    return simulate(
        scenario, averaging_through(vectors, optimizer), vectors[0].nbytes, _progress(config.rounds)
    )


def _progress(rounds: int) -> Callable[[int], None]:
    """A line on stderr at most every PROGRESS_EVERY_S: the furthest round a node has taken."""
    started = said = time.monotonic()
    furthest = 0

    def on_round(r: int) -> None:
        nonlocal said, furthest
        furthest = max(furthest, r)
        if time.monotonic() - said >= PROGRESS_EVERY_S:
            said = time.monotonic()
            print(
                f"simulating: round {furthest} of {rounds} ({said - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    return on_round


def _table(result: SimResult, config: SimulateConfig, out: TextIO) -> None:
    points = result.rounds
    shown = sorted({points[i * (len(points) - 1) // max(TABLE_ROWS - 1, 1)].round for i in range(TABLE_ROWS)})
    accuracy = any(p.accuracy is not None for p in points)
    print(
        f"{'round':>6} {'consensus':>11} {'virtual s':>10} {'MB/node':>10} {'nodes':>6}"
        + ("  accuracy" if accuracy else ""),
        file=out,
    )
    for point in (p for p in points if p.round in shown):
        print(_row(point, accuracy), file=out)
    where = f"{config.nodes} nodes, {config.algorithm}" + (
        f" on {config.topology}" if config.topology else ""
    )
    print(f"simulated {where}: {len(points)} rounds in {result.sim_seconds:.2f} s", file=out)


def _row(point: RoundPoint, accuracy: bool) -> str:
    text = (
        f"{point.round:>6} {point.consensus_distance:>11.3e} {point.virtual_time_s:>10.3f} "
        f"{point.bytes_per_node / 1e6:>10.1f} {point.nodes:>6}"
    )
    return text + (f"  {point.accuracy:8.3f}" if accuracy and point.accuracy is not None else "")
