"""The gossipmesh daemon and command line.

``gossipmesh node`` runs one daemon: config -> wiring (peer, task, model, gossip optimizer) ->
training loop -> graceful stop (leave the mesh, write the report). ``gossipmesh mesh`` runs a
local test mesh of daemons as separate processes. ``python node.py ...`` is ``gossipmesh ...``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

from gossip.state import CHUNK_BYTES as STATE_CHUNK_BYTES
from p2p import AddressError, Peer, TransportError
from p2p.address import split_endpoint
from p2p.membership import NOT_YET, PROFILES
from p2p.wire import Limits
from runtime import simulate, topology_view
from runtime.config import (
    ConfigError,
    MeshConfig,
    NodeConfig,
    add_arguments,
    parse_args_into,
    summary,
)
from runtime.console import emit, say
from runtime.launcher import run_mesh
from runtime.report import NodeRecord, build_report, write_json
from runtime.trainer import Trainer
from tasks import load_task
from topologies import NAMES, TopologyError, analyze, member_order


def run_node(config: NodeConfig, stop: threading.Event) -> NodeRecord:
    """Run one daemon until its steps or duration are spent or ``stop`` is set.

    The report (and the final parameters, if asked) are written whatever happens once the
    node is listening. Raises TransportError / AddressError / TopologyError for what the user
    must fix.
    """
    origin = config.clock_origin if config.clock_origin is not None else time.time()

    def clock() -> float:
        """The report clock: seconds since the mesh (or this lone node) started."""
        return time.time() - origin

    if config.threads:
        torch.set_num_threads(config.threads)
    task = load_task(config.task)
    model = task.model(config.seed)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    node_id = config.id or _default_id(config.listen)
    joins_running_mesh = bool(config.bootstrap or config.beacon) and config.expect == 0
    # A node takes part in gossip rounds only once it is ready to train (imports done, model and
    # optimizer built): members that start together wait for each other at round 0, so a node
    # that is seconds slower to start is not averaged around.
    announces_later = joins_running_mesh or config.expect > 1
    peer = Peer(
        node_id,
        config.listen,
        config.bootstrap,
        advertise=config.advertise,
        limits=Limits(max_message_bytes=max(model_bytes, STATE_CHUNK_BYTES)),
        profile=PROFILES[config.profile],
        clock=clock,
        first_round=NOT_YET if announces_later else 0,
        beacon_port=config.beacon,
        mesh_name=config.mesh_name,
    )
    peer.start()
    record = NodeRecord(id=node_id, rank=-1, address=peer.address)
    started = time.monotonic()
    try:
        say(config.progress, f"{node_id} listening on {peer.address}")
        peer.wait_ready(config.startup_timeout, expect=max(1, config.expect), cancelled=stop.is_set)
        ordered = member_order(peer.members())
        record.rank = ordered.index(node_id)
        config.graph.graph(len(ordered))  # fail now if the topology is undefined for this mesh
        emit(config.progress, {"event": "ready", "id": node_id, "rank": record.rank, "members": ordered})
        trainer = Trainer(config, task, model, peer, record, clock)
        if joins_running_mesh and len(ordered) > 1 and not stop.is_set():
            trainer.join_running_mesh()
            record.t_joined = round(clock(), 3)
        elif announces_later:
            peer.start_at_round(0)
            expect = max(1, config.expect)
            peer.wait_ready(config.startup_timeout, expect=expect, round=0, cancelled=stop.is_set)
        if not stop.is_set():
            trainer.run(stop)
        record.status = "finished"
    except Exception as exc:
        record.status = "failed"
        record.error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, TransportError | AddressError | TopologyError):
            raise
        traceback.print_exc()
    finally:
        peer.close()
        _count_network(record, peer)
        _save(config, record, model, peer.membership.events, time.monotonic() - started)
    return record


def _count_network(record: NodeRecord, peer: Peer) -> None:
    """Add the transport's counters to the algorithm's (already in the record)."""
    stats = peer.stats
    record.bytes_sent = stats.bytes_sent
    record.bytes_received = stats.bytes_received
    record.rejected_by_reason = dict(Counter(record.rejected_by_reason) + stats.rejected)
    record.messages_rejected = sum(record.rejected_by_reason.values())
    record.dropped_by_reason = dict(Counter(record.dropped_by_reason) + stats.dropped)


def _save(
    config: NodeConfig,
    record: NodeRecord,
    model: torch.nn.Module,
    events: list[dict[str, Any]],
    wall_time_s: float,
) -> None:
    if config.save_params is not None:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        _save_array(config.save_params, flat)
    if config.report is not None:
        report = build_report(
            wall_time_s=round(wall_time_s, 3),
            config=summary(config),
            nodes=[asdict(record)],
            consensus_distance=0.0,
            membership_events=events,
        )
        write_json(config.report, report)


def _save_array(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as stream:
        np.save(stream, array, allow_pickle=False)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)


def _default_id(listen: str) -> str:
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:40]
    _, port = split_endpoint(listen)
    return f"{host.strip('-.') or 'node'}-{port or os.getpid()}"


# -- command line ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gossipmesh",
        description="Decentralized peer-to-peer training: gossip averaging over ZeroMQ.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    node = commands.add_parser(
        "node",
        help="run one daemon",
        description="Run one node daemon. Every option can also come from --config FILE.toml "
        "or a GOSSIPMESH_<OPTION> environment variable (flags win).",
    )
    add_arguments(node, NodeConfig)
    mesh = commands.add_parser(
        "mesh",
        help="run a local test mesh of daemons on 127.0.0.1",
        description="Start N daemons as separate processes on 127.0.0.1, show a live table, write a report.",
    )
    add_arguments(mesh, MeshConfig)
    topology = commands.add_parser(
        "topology",
        help="inspect a topology: degree, spectral gap, diameter, bytes per round; draw it",
        description="Analyse a topology for N nodes (or compare all of them) and draw it.",
    )
    topology.add_argument("name", nargs="?", help=f"NAME or NAME:key=value,...; one of {', '.join(NAMES)}")
    topology.add_argument("--nodes", type=int, default=16, metavar="N", help="node count (default: 16)")
    topology.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="a parameter")
    topology.add_argument("--json", action="store_true", help="print the analysis as JSON")
    topology.add_argument("--png", type=Path, metavar="FILE", help="draw the graph (round 0) to a PNG")
    topology.add_argument("--compare", action="store_true", help="a table of every named topology")
    topology.add_argument(
        "--model-bytes",
        type=int,
        metavar="B",
        help="model size for bytes per round (default: the digits MLP)",
    )
    simulate.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "topology":
            return _topology_command(args, parser)
        if args.command == "simulate":
            return simulate.run(args)
        if args.command == "node":
            config = parse_args_into(NodeConfig, args, os.environ)
            return _node_command(config)
        mesh_config = parse_args_into(MeshConfig, args, os.environ)
        _preload_for_nodes()
        return run_mesh(mesh_config, node_main=main)
    except (ConfigError, AddressError, TransportError, TopologyError) as exc:
        print(f"gossipmesh: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1


def _topology_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.nodes < 1:
        parser.error("--nodes must be >= 1")
    model_bytes = args.model_bytes
    if model_bytes is None:
        model_bytes = sum(p.numel() * p.element_size() for p in load_task("digits").model(0).parameters())
    if args.compare:
        topology_view.compare(args.nodes, model_bytes, sys.stdout)
        return 0
    if args.name is None:
        parser.error("give a topology NAME, or --compare")
    topology = topology_view.with_params(args.name, args.param)
    analysis = analyze(topology, args.nodes, model_bytes)
    if args.json:
        print(topology_view.as_json(analysis))
    else:
        topology_view.describe(analysis, sys.stdout)
    if args.png is not None:
        topology_view.draw_png(topology, args.nodes, args.png)
        if not args.json:
            print(f"drawing        {args.png}")
    return 0


def _preload_for_nodes() -> None:
    """Import once, before the mesh forks its nodes, what each would import: building the first
    torch optimizer pulls in torch._dynamo, seconds of CPU per process."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _node_command(config: NodeConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():  # a second signal: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        print(f"{signal.Signals(signum).name}: finishing the current step", file=sys.stderr)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    record = run_node(config, stop)
    if record.status == "failed":
        print(f"gossipmesh: node failed: {record.error}", file=sys.stderr)
        return 1
    final = record.final
    say(
        config.progress,
        f"{record.id} finished: {record.steps} steps, held-out accuracy "
        f"{final.get('accuracy', math.nan):.3f}, loss {final.get('loss', math.nan):.4f}",
    )
    return 0


def cli() -> None:
    """The console entry point: ``main``, then exit without tearing down the interpreter.

    Everything the run owns (report, sockets) is closed by then; skipping the interpreter's
    teardown of torch saves ~2 s per process, which adds up in a mesh on few cores.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    cli()
