"""The gossipmesh daemon and command line.

``gossipmesh node`` runs one daemon: config -> wiring (peer, task, model, gossip optimizer) ->
training loop -> graceful stop (leave the mesh, write the report). ``gossipmesh mesh`` runs a
local test mesh of daemons as separate processes; ``gossipmesh keygen DIR`` makes a node's
CURVE key pair. ``python node.py ...`` is ``gossipmesh ...``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

from p2p import AddressError, Peer, TransportError
from p2p.membership import NOT_YET
from p2p.security import SecurityError, insecure_warning, keygen
from runtime import logs, report_view, simulate, topology_view
from runtime.checkpoint import load_newest
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
from runtime.metrics import NodeMetrics
from runtime.peers import default_id, default_name, make_peer
from runtime.report import NodeRecord, build_report, read_json, write_json
from runtime.status_server import StatusServer, StatusServerError
from runtime.trainer import Trainer
from tasks import load_task
from topologies import NAMES, TopologyError, analyze, member_order

log = logging.getLogger(logs.NODE_LOGGER)
# what a user must fix (the message says how), reported without a traceback
USER_ERRORS = (AddressError, TransportError, TopologyError, StatusServerError, SecurityError)


def run_node(config: NodeConfig, stop: threading.Event) -> NodeRecord:
    """Run one daemon until its steps or duration are spent or ``stop`` is set.

    The report (and the final parameters, if asked) are written whatever happens once the
    node is listening. Raises TransportError / AddressError / TopologyError / StatusServerError
    for what the user must fix.
    """
    origin = config.clock_origin if config.clock_origin is not None else time.time()

    def clock() -> float:
        """The report clock: seconds since the mesh (or this lone node) started."""
        return time.time() - origin

    if config.threads:
        torch.set_num_threads(config.threads)
    task = load_task(config.task)
    model = task.model(config.seed).to(config.device)
    node_id = config.id or default_id(config.listen)
    if config.insecure:
        say(config.progress, f"WARNING: {insecure_warning()}")
    checkpoint = load_newest(config.state_dir) if config.state_dir is not None else None
    # a node resumed from a checkpoint rejoins the mesh it crashed out of, whatever --expect says
    joins_running_mesh = bool(config.bootstrap or config.beacon) and (
        config.expect == 0 or checkpoint is not None
    )
    expect = 1 if joins_running_mesh else max(1, config.expect)
    # A node takes part in gossip rounds only once it is ready to train (imports done, model and
    # optimizer built): members that start together wait for each other at round 0, so a node
    # that is seconds slower to start is not averaged around.
    announces_later = joins_running_mesh or config.expect > 1
    peer = make_peer(
        config, model, node_id=node_id, clock=clock, first_round=NOT_YET if announces_later else 0
    )
    peer.transport.on_failure = lambda _: stop.set()  # a node whose network died must not train on
    metrics = NodeMetrics(stale_after_s=config.startup_timeout + 10 * config.round_timeout)
    metrics.peer = peer
    status: StatusServer | None = None

    def cancelled() -> bool:
        metrics.beat()  # waiting for peers is the daemon's loop making progress
        return stop.is_set()

    peer.start()
    record = NodeRecord(id=node_id, rank=-1, address=peer.address, device=config.device)
    started = time.monotonic()
    try:
        say(
            config.progress, f"{node_id} listening on {peer.address}", event="listening", address=peer.address
        )
        if config.metrics_port is not None:
            status = StatusServer(metrics, config.metrics_port, config.metrics_host)
            say(config.progress, f"{node_id} metrics on :{status.port}/metrics", metrics_port=status.port)
        peer.wait_ready(config.startup_timeout, expect=expect, cancelled=cancelled)
        ordered = member_order(peer.members())
        record.rank = ordered.index(node_id)
        config.graph.graph(len(ordered))  # fail now if the topology is undefined for this mesh
        emit(config.progress, {"event": "ready", "id": node_id, "rank": record.rank, "members": ordered})
        trainer = Trainer(config, task, model, peer, record, clock, metrics)
        if checkpoint is not None:
            trainer.resume(checkpoint)
            record.resumed_from = str(checkpoint.path)
            say(config.progress, f"{node_id} resumed from {checkpoint.path} (step {record.steps})")
        if joins_running_mesh and len(ordered) > 1 and trainer.join_running_mesh(cancelled):
            record.t_joined = round(clock(), 3)
        elif announces_later:  # (also when no member trains yet: those present start together)
            peer.start_at_round(0)
            if joins_running_mesh:  # each member present starts with us, or takes our state

                def serving() -> bool:
                    trainer.optimizer.serve_state()
                    return cancelled()

                announced = NOT_YET - 1  # the members of this "round" have announced a first round
                peer.wait_ready(
                    config.startup_timeout, expect=len(ordered), round=announced, cancelled=serving
                )
            else:
                peer.wait_ready(config.startup_timeout, expect=expect, round=0, cancelled=cancelled)
        if not stop.is_set():
            trainer.run(stop)
        peer.transport.check_running()  # a network that died stopped training: that is a failure
        record.status = "finished"
    except Exception as exc:
        record.status = "failed"
        record.error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, USER_ERRORS):
            raise
        log.exception("training failed")
    finally:
        metrics.leaving()
        peer.close()
        if status is not None:
            status.close()
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
    record.rejected_by_peer = {peer: dict(reasons) for peer, reasons in stats.rejected_by_peer.items()}
    record.shunned_peers = sorted(stats.rejections.shunned_peers)


def _save(
    config: NodeConfig,
    record: NodeRecord,
    model: torch.nn.Module,
    events: list[dict[str, Any]],
    wall_time_s: float,
) -> None:
    """The report first (it says what happened, whatever fails after it), then the parameters."""
    if config.report is not None:
        report = build_report(
            wall_time_s=round(wall_time_s, 3),
            config=summary(config),
            nodes=[asdict(record)],
            consensus_distance=0.0,
            membership_events=events,
        )
        write_json(config.report, report)
    if config.save_params is not None:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        _save_array(config.save_params, flat)


def _save_array(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as stream:
        np.save(stream, array, allow_pickle=False)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)


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
    report = commands.add_parser(
        "report",
        help="summarize a run report and plot it",
        description="Print where each node's time went and plot loss, accuracy, consensus distance "
        "and bytes/s against wall time, with kills, joins and pauses marked.",
    )
    report.add_argument("run", type=Path, metavar="RUN.json", help="a report of gossipmesh mesh or node")
    report.add_argument(
        "--png", type=Path, metavar="FILE", help="the plot (default: RUN.png beside RUN.json)"
    )
    keys = commands.add_parser(
        "keygen",
        help="make a node's CURVE key pair",
        description="Write DIR/NAME.key (public: copy it into the --trusted folder of every node "
        "that should admit this one) and DIR/NAME.key_secret (secret, mode 0600; pass --keys DIR).",
    )
    keys.add_argument("dir", type=Path, metavar="DIR", help="folder for the key pair (created if missing)")
    keys.add_argument("--name", default=default_name(), help="file name of the pair (default: host name)")
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
        if args.command == "report":
            return _report_command(args.run, args.png or args.run.with_suffix(".png"))
        if args.command == "keygen":
            public, secret = keygen(args.dir, args.name)
            print(f"public key {public}  (copy it into every trusted folder)\nsecret key {secret}")
            return 0
        if args.command == "simulate":
            return simulate.run(args)
        if args.command == "node":
            config = parse_args_into(NodeConfig, args, os.environ)
            return _node_command(config)
        mesh_config = parse_args_into(MeshConfig, args, os.environ)
        _preload_for_nodes()
        return run_mesh(mesh_config, node_main=main)
    except (ConfigError, *USER_ERRORS) as exc:
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


def _report_command(run: Path, png: Path) -> int:
    try:
        report = read_json(run)
    except (OSError, ValueError) as exc:
        print(f"gossipmesh: error: cannot read report {run}: {exc}", file=sys.stderr)
        return 1
    print("\n".join(report_view.summarize(report)))
    report_view.plot(report, png)
    print(f"plot: {png}")
    return 0


def _preload_for_nodes() -> None:
    """Import once, before the mesh forks its nodes, what each would import: building the first
    torch optimizer pulls in torch._dynamo, seconds of CPU per process."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _node_command(config: NodeConfig) -> int:
    logs.configure(config.log_format)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():  # a second signal: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        log.info("%s: finishing the current step", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    record = run_node(config, stop)
    if record.status == "failed":
        log.error("gossipmesh: node failed: %s", record.error)
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
