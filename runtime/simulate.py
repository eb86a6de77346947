"""``gossipmesh simulate``: a mesh of N nodes running the real averaging code in virtual time.

Pure averaging (``--model-size``, the default) starts every node from a random vector and
charges each message as if it carried a model of that size; ``--task`` trains the task's real
model on every node (small N). ``--algorithm allreduce`` is the ring-allreduce time model.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from gossip import Algorithm, AlgorithmError, CodecError, parse_codec
from runtime.config import ConfigError, _check
from sim.allreduce import ring_allreduce
from sim.network import Link
from sim.run import RoundPoint, SimResult, averaging, simulate, start_vectors
from sim.scenario import Compute, Scenario, Stragglers
from sim.training import model_nbytes, training
from tasks import TASKS, load_task
from topologies import NAMES, Topology, TopologyError

ALLREDUCE = "allreduce"
TABLE_ROWS = 20  # rounds shown in the table (evenly spaced, the last one always)
DEFAULT_MODEL_BYTES = 100_000_000  # about ResNet-50 in float32


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "simulate",
        help="simulate a mesh of N nodes (thousands) in virtual time, with the real gossip code",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, default=64, metavar="N", help="node count (default: 64)")
    parser.add_argument(
        "--topology", metavar="T", help=f"one of {', '.join(NAMES)} (default: the algorithm's)"
    )
    parser.add_argument(
        "--algorithm",
        default="dpsgd",
        metavar="A",
        help="dpsgd, sgp, adpsgd, choco (NAME:key=value,...) or allreduce",
    )
    workload = parser.add_mutually_exclusive_group()
    workload.add_argument(
        "--model-size", type=int, metavar="BYTES", help="model size on the wire (default: 100 MB)"
    )
    workload.add_argument("--task", choices=TASKS, help="train this task's real model on every node")
    parser.add_argument(
        "--straggler", metavar="FRACTION:FACTOR", help="e.g. 0.05:4: 5%% of the nodes 4x slower"
    )
    parser.add_argument(
        "--latency", type=float, default=1.0, metavar="MS", help="link latency (default: 1 ms)"
    )
    parser.add_argument(
        "--bandwidth", type=float, default=10.0, metavar="GBPS", help="link bandwidth (default: 10)"
    )
    parser.add_argument(
        "--rounds", type=int, default=30, metavar="R", help="local steps per node (default: 30)"
    )
    parser.add_argument(
        "--compute-ms", type=float, default=100.0, metavar="MS", help="step time (default: 100)"
    )
    parser.add_argument(
        "--jitter", type=float, default=0.0, help="lognormal shape of step times (default: 0)"
    )
    parser.add_argument("--loss", type=float, default=0.0, help="probability a message is lost (default: 0)")
    parser.add_argument("--compression", default="none", metavar="CODEC", help="codec for choco")
    parser.add_argument(
        "--round-timeout", type=float, default=2.0, metavar="S", help="longest wait (default: 2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    parser.add_argument("--json", action="store_true", help='print {"rounds": [...], "sim_seconds": S}')


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    scenario = _scenario(args)
    if args.algorithm == ALLREDUCE:
        if args.task:
            raise ConfigError("--algorithm allreduce is a time model; use --model-size, not --task")
        result = SimResult(
            ring_allreduce(scenario, scenario.model_bytes or DEFAULT_MODEL_BYTES), 0.0, {}, 0, {}
        )
    else:
        result = _gossip(args, scenario)
    if args.json:
        print(json.dumps(result.as_json()), file=out)
    else:
        _table(result, args, out)
    return 0


def _scenario(args: argparse.Namespace) -> Scenario:
    _check(args.nodes >= 1, "--nodes", f"must be >= 1, got {args.nodes}")
    _check(args.rounds >= 1, "--rounds", f"must be >= 1, got {args.rounds}")
    _check(
        args.latency >= 0 and args.bandwidth > 0, "--latency/--bandwidth", "need latency >= 0, bandwidth > 0"
    )
    _check(args.compute_ms >= 0 and args.jitter >= 0, "--compute-ms/--jitter", "must be >= 0")
    _check(0 <= args.loss < 1, "--loss", f"must be in [0, 1), got {args.loss}")
    _check(args.model_size is None or args.model_size > 0, "--model-size", "must be > 0 bytes")
    try:
        stragglers = Stragglers.parse(args.straggler) if args.straggler else Stragglers()
    except ValueError as exc:
        raise ConfigError(f"--straggler: {exc}") from None
    return Scenario(
        nodes=args.nodes,
        rounds=args.rounds,
        compute=Compute(args.compute_ms / 1000, args.jitter, stragglers),
        link=Link(args.latency / 1000, args.bandwidth * 1e9 / 8),
        loss=args.loss,
        model_bytes=None if args.task else (args.model_size or DEFAULT_MODEL_BYTES),
        round_timeout=args.round_timeout,
        seed=args.seed,
    )


def _gossip(args: argparse.Namespace, scenario: Scenario) -> SimResult:
    try:
        algorithm = Algorithm.parse(args.algorithm)
        topology = Topology.parse(args.topology or algorithm.default_topology)
        codec = parse_codec(args.compression)
        if args.task:
            task = load_task(args.task)
            build = training(task, args.nodes, algorithm, topology, args.round_timeout, codec, args.seed)
            return simulate(scenario, build, model_nbytes(task, args.seed))
        vectors = start_vectors(args.nodes, args.seed)
        build = averaging(vectors, algorithm, topology, args.round_timeout, codec)
        return simulate(scenario, build, vectors[0].nbytes)
    except AlgorithmError as exc:
        raise ConfigError(f"--algorithm: {exc}; or allreduce") from None
    except (TopologyError, CodecError) as exc:
        raise ConfigError(f"--topology/--compression: {exc}") from None
    except ValueError as exc:  # an algorithm that cannot run on this topology or codec
        raise ConfigError(str(exc)) from None


def _table(result: SimResult, args: argparse.Namespace, out: TextIO) -> None:
    points = result.rounds
    shown = sorted({points[i * (len(points) - 1) // max(TABLE_ROWS - 1, 1)].round for i in range(TABLE_ROWS)})
    accuracy = any(p.accuracy is not None for p in points)
    print(
        f"{'round':>6} {'consensus':>11} {'virtual s':>10} {'MB/node':>10}"
        + ("  accuracy" if accuracy else ""),
        file=out,
    )
    for point in (p for p in points if p.round in shown):
        print(_row(point, accuracy), file=out)
    where = f"{args.nodes} nodes, {args.algorithm}" + (f" on {args.topology}" if args.topology else "")
    print(f"simulated {where}: {len(points)} rounds in {result.sim_seconds:.2f} s", file=out)


def _row(point: RoundPoint, accuracy: bool) -> str:
    text = (
        f"{point.round:>6} {point.consensus_distance:>11.3e} {point.virtual_time_s:>10.3f} "
        f"{point.bytes_per_node / 1e6:>10.1f}"
    )
    return text + (f"  {point.accuracy:8.3f}" if accuracy and point.accuracy is not None else "")
