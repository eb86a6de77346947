"""``gossipmesh simulate``: a mesh of N nodes running the real averaging code in virtual time.

Pure averaging (``--model-size``, the default) starts every node from a random vector and
charges each message as if it carried a model of that size; ``--task`` trains the task's real
model on every node (small N). ``--algorithm allreduce`` is the ring-allreduce time model.
Faults (``--crash``, ``--join``, ``--partition``) happen at given virtual times, in seconds
from the start; each flag can be given several times.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TextIO

from gossip import Algorithm, AlgorithmError, CodecError, parse_codec
from runtime.config import ConfigError, _check
from sim.allreduce import ring_allreduce
from sim.network import Link, Partition
from sim.run import RoundPoint, SimResult, averaging, simulate, start_vectors
from sim.scenario import Compute, Crash, Scenario, Stragglers, crash_waves, parse_pair, split_in_halves
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
    parser.add_argument(
        "--crash",
        action="append",
        default=[],
        metavar="FRACTION@SECONDS",
        help="e.g. 0.1@2: 10%% of the nodes (drawn with the seed) crash 2 virtual s in; the others drop "
        f"them from the membership {Scenario.detect_s:g} s later",
    )
    parser.add_argument(
        "--join",
        action="append",
        default=[],
        metavar="COUNT@SECONDS",
        help="e.g. 8@3: 8 new nodes join 3 virtual s in, each starting from a live node's model",
    )
    parser.add_argument(
        "--partition",
        action="append",
        default=[],
        metavar="START:END",
        help="e.g. 1:4: from 1 to 4 virtual s no message crosses between the first half of the nodes "
        "(node-0 .. node-N/2-1) and the rest (joiners included)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    parser.add_argument("--json", action="store_true", help='print {"rounds": [...], "sim_seconds": S}')


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    scenario = _scenario(args)
    if args.algorithm == ALLREDUCE:
        if args.task:
            raise ConfigError("--algorithm allreduce is a time model; use --model-size, not --task")
        _check(
            not (args.crash or args.join or args.partition),
            "--crash/--join/--partition",
            "--algorithm allreduce is a time model without faults; simulate a gossip algorithm",
        )
        result = SimResult(
            ring_allreduce(scenario, scenario.model_bytes or DEFAULT_MODEL_BYTES), 0.0, {}, 0, {}
        )
    else:
        result = _gossip(args, scenario)
    if args.json:
        print(json.dumps(result.as_json()), file=out)
    else:
        _table(result, args, out)
    _warn_after_the_end(scenario, result.rounds[-1].virtual_time_s)
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
        crashes=_crashes(args),
        joins=_joins(args),
        partitions=_partitions(args),
        round_timeout=args.round_timeout,
        seed=args.seed,
    )


def _crashes(args: argparse.Namespace) -> tuple[Crash, ...]:
    waves = []
    for text in args.crash:
        fraction, at_s = _fault(text, "--crash", "@", "FRACTION@SECONDS", "0.1@2")
        _check(
            round(fraction * args.nodes) >= 1 and fraction <= 1,
            "--crash",
            f"{text!r}: FRACTION must be in [{1 / args.nodes:.3g}, 1] (one of {args.nodes} nodes at least)",
        )
        waves.append((fraction, at_s))
    crashes = crash_waves(waves, args.nodes, args.seed)
    _check(
        len(crashes) < args.nodes, "--crash", f"together they crash all {args.nodes} nodes; leave one running"
    )
    return crashes


def _joins(args: argparse.Namespace) -> list[float]:
    joins = []
    for text in args.join:
        count, at_s = _fault(text, "--join", "@", "COUNT@SECONDS", "8@3")
        _check(count >= 1 and count.is_integer(), "--join", f"{text!r}: COUNT must be a whole number >= 1")
        joins += [at_s] * int(count)
    return joins


def _partitions(args: argparse.Namespace) -> list[Partition]:
    partitions = []
    for text in args.partition:
        start, end = _fault(text, "--partition", ":", "START:END", "1:4")
        _check(0 <= start < end, "--partition", f"{text!r}: need 0 <= START < END, e.g. 1:4 (healed at 4 s)")
        _check(args.nodes >= 2, "--partition", "splits the nodes in two halves: needs --nodes >= 2")
        partitions.append(split_in_halves(start, end, args.nodes))
    return partitions


def _fault(text: str, flag: str, separator: str, form: str, example: str) -> tuple[float, float]:
    """A fault flag's two numbers; the second (a virtual time) must be >= 0."""
    value, seconds = parse_pair(text, separator)
    _check(
        math.isfinite(value) and math.isfinite(seconds) and seconds >= 0,
        flag,
        f"{text!r}: expected {form} with virtual seconds >= 0, e.g. {example}",
    )
    return value, seconds


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
        f"{'round':>6} {'consensus':>11} {'virtual s':>10} {'MB/node':>10} {'nodes':>6}"
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
        f"{point.bytes_per_node / 1e6:>10.1f} {point.nodes:>6}"
    )
    return text + (f"  {point.accuracy:8.3f}" if accuracy and point.accuracy is not None else "")
