"""The local test mesh: N daemons as separate OS processes on 127.0.0.1, or each on a host of
its own (``--hosts netns``: a Linux network namespace on one bridged LAN, ``gossipmesh.mesh.netns``,
whose links ``--link`` limits with ``tc tbf``).

Each node runs the daemon's own entry point (``gossipmesh node ...``) with a free port (port
7000 of its host), one compute thread and the shared report clock. The first node starts the
mesh; the others join through its address alone and wait until all N are members
(``--expect N``), then all train from round 0. Unless ``--insecure``, the launcher makes a CURVE
key pair per node and a trusted folder of their public keys (a joiner's key is added before it
starts: nodes re-read the folder). The launcher reads the nodes' JSON progress lines into a live
table, carries out the fault schedule (``--kill``, ``--leave``, ``--pause``, ``--join``), stops
every node on Ctrl-C or SIGTERM, and merges the nodes' reports into one (adding the consensus
distance of the final models, and ``links``: where the nodes ran and their uplink caps).

Nodes are forked from the launcher after it has imported what every node needs, as PyTorch's
DataLoader forks its workers: on a machine with few cores, N fresh interpreters each importing
torch would take longer than the training. The launcher runs no threads, so forking (also in the
middle of a run, for ``--join``) is safe. Each node gets its own session, so a Ctrl-C in the
terminal reaches only the launcher, which then stops the nodes gracefully.
"""

from __future__ import annotations

import selectors
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from gossip import consensus_distance
from gossipmesh import report_view
from gossipmesh.config import ConfigError, MeshConfig, as_flags, summary
from gossipmesh.config.values import ChaosAction
from gossipmesh.console import LiveTable
from gossipmesh.mesh import netns
from gossipmesh.mesh.average import AverageModel, LiveAverage, distances_from
from gossipmesh.mesh.node_process import NodeMain, NodeProcess, preload_for_nodes
from gossipmesh.report import build_report, write_json
from p2p.address import free_ports
from p2p.security.curve import keygen

STOP_GRACE_S = 10.0
HOST_PORT = 7000  # every namespace host's node listens here
_REFRESH_S = 0.25


class Mesh:
    """The processes of one local mesh and its fault schedule."""

    def __init__(
        self,
        config: MeshConfig,
        node_main: NodeMain,
        run_dir: Path,
        hosts: list[netns.Host] | None = None,
        *,
        live_params: bool = False,
    ) -> None:
        self.config = config
        self.live_params = live_params  # nodes rewrite a copy of their parameters (mesh.average)
        self.hosts = hosts  # a namespace host per node, joiners' included (None: 127.0.0.1)
        self.node_main = node_main
        self.run_dir = run_dir
        self.origin = time.time()
        self.nodes: list[NodeProcess] = []
        self.chaos: list[dict[str, Any]] = []  # what was done, on the mesh clock
        self.chaos_delay_s = 0.0  # how late the fault schedule runs: see :meth:`schedule_delay`
        self._schedule_started = self._schedule_held = False
        self._selector = selectors.DefaultSelector()
        self._slowdown = config.by_rank("slowdown")
        self._batch = config.by_rank("node_batch")
        self._byzantine = config.by_rank("byzantine")
        self._device = config.by_rank("node_device")
        self.trusted = run_dir / "trusted"

    def clock(self) -> float:
        return time.time() - self.origin

    def start_node(self, port: int, bootstrap: str | None, *, expect: int) -> NodeProcess:
        rank = len(self.nodes)
        host = self.hosts[rank] if self.hosts is not None else None
        address = f"tcp://{host.address}:{HOST_PORT}" if host is not None else f"tcp://127.0.0.1:{port}"
        node = NodeProcess(rank, address, self.run_dir)
        argv = [
            "node",
            "--id", node.id,
            "--listen", node.address,
            "--expect", str(expect),
            "--report", str(node.report),
            "--save-params", str(node.params),
            *(["--live-params", str(node.live_params)] if self.live_params else []),
            "--progress", "json",
            "--clock-origin", repr(self.origin),
            "--slowdown", str(self._slowdown.get(rank, 1.0)),
            "--threads", "1",
            *(["--bootstrap", bootstrap] if bootstrap else []),
            *(["--no-listen"] if rank in self.config.no_listen else []),
            *as_flags(self.config),
            *(["--batch-size", str(self._batch[rank])] if rank in self._batch else []),
            *(["--metrics-port", str(self.config.metrics_port + rank)] if self.config.metrics_port else []),
            *(["--byzantine", str(self._byzantine[rank])] if rank in self._byzantine else []),
            *(["--device", self._device[rank]] if rank in self._device else []),
            *self._security_flags(node.id),
        ]  # fmt: skip
        node.start(self.node_main, argv, enter=(lambda: netns.enter(host)) if host is not None else None)
        self._selector.register(node.progress_fd, selectors.EVENT_READ, node)
        self.nodes.append(node)
        return node

    def _security_flags(self, node_id: str) -> list[str]:
        """--insecure, or a fresh key pair for the node with its public key made trusted."""
        if self.config.insecure:
            return ["--insecure"]
        keys = self.run_dir / "keys" / node_id
        public, _ = keygen(keys, node_id)
        self.trusted.mkdir(exist_ok=True)
        # Whole or not at all: running nodes re-read the folder when it changes, and one that
        # read a half-written key refused the joiner's first connection.
        staged = self.trusted / f".{public.name}.part"
        shutil.copy(public, staged)
        staged.replace(self.trusted / public.name)
        return ["--keys", str(keys), "--trusted", str(self.trusted)]

    def training(self) -> bool:
        """Every node has made its first step (or exited)."""
        return all(n.timeline or n.poll() is not None for n in self.nodes)

    def schedule_delay(self, first_at: float) -> float | None:
        """How late the fault schedule runs, or None while it must wait: its first fault is due
        but not every node trains yet (a fault during startup would test the startup, not the
        training). A schedule that waited shifts whole, keeping the faults' spacing."""
        if self._schedule_started or self.clock() < first_at:
            return self.chaos_delay_s
        if not self.training():
            self._schedule_held = True
            return None
        if self._schedule_held:
            self.chaos_delay_s = round(self.clock() - first_at, 3)
        self._schedule_started = True
        return self.chaos_delay_s

    def live(self) -> list[NodeProcess]:
        return [n for n in self.nodes if n.poll() is None and n.t_killed is None]

    def act(self, action: ChaosAction) -> None:
        t = round(self.clock(), 3)
        if action.action == "join":
            contacts = self.live()
            for port in free_ports(action.count, block=self.config.local_ranks):
                joiner = self.start_node(port, contacts[0].address if contacts else None, expect=0)
                self.chaos.append({"t": t, "action": "join", "node": joiner.id})
            return
        node = self.nodes[action.rank] if action.rank < len(self.nodes) else None
        if node is None or node.poll() is not None:
            return
        signals = {
            "kill": signal.SIGKILL,
            "leave": signal.SIGTERM,
            "pause": signal.SIGSTOP,
            "resume": signal.SIGCONT,
        }
        signum = signals[action.action]
        if action.action == "kill":
            node.t_killed = t
        node.send_signal(signum)
        self.chaos.append({"t": t, "action": action.action, "node": node.id})

    def read_progress(self, timeout: float) -> None:
        for key, _ in self._selector.select(timeout):
            node: NodeProcess = key.data
            if not node.read_available():
                self._selector.unregister(key.fileobj)
                node.close_progress()

    def drain(self) -> None:
        """Read every node's last progress lines (all have exited)."""
        while self._selector.get_map():
            self.read_progress(0.5)


def run_mesh(config: MeshConfig, node_main: NodeMain, stream: TextIO | None = None) -> int:
    """Run the mesh to the end; returns 0 when every node finished or was killed on purpose.

    ``node_main`` is the daemon's command-line entry point, called in each forked node.
    """
    stream = stream or sys.stdout
    config = config.bounded()
    run_dir = config.run_dir or Path("runs") / time.strftime("mesh-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    report_path = config.report or run_dir / "report.json"
    print(
        f"gossipmesh mesh: {config.nodes} nodes, {config.graph} topology, {config.averaging}, "
        f"task {config.task}; logs in {run_dir}",
        file=stream,
        flush=True,  # a buffered line would be written again by every forked node
    )
    preload_for_nodes()  # (torch: seconds, after the line above says what is starting)
    stop = threading.Event()
    with _hosts(config) as hosts, _forward_termination(stop):
        average = AverageModel(config)
        mesh = Mesh(config, node_main, run_dir, hosts, live_params=average.live)
        first_port, *other_ports = free_ports(config.nodes, block=config.local_ranks)
        first = mesh.start_node(first_port, None, expect=config.nodes)
        for port in other_ports:
            mesh.start_node(port, first.address, expect=config.nodes)
        live = LiveAverage(average, mesh.origin) if average.live else None
        _watch(mesh, config.chaos(), stop, LiveTable(stream, interactive=stream.isatty()), live)
        wire = {n.id: netns.sent_bytes(h) for n, h in zip(mesh.nodes, hosts, strict=False)} if hosts else {}
    results = [node.result() for node in mesh.nodes]
    ended = [r for r in results if r["status"] in ("finished", "killed")]
    finished = [n for n, r in zip(mesh.nodes, results, strict=True) if r["status"] == "finished"]
    final = {n.id: np.load(n.params, allow_pickle=False) for n in finished if n.params.exists()}
    finals = list(final.values())
    report = build_report(
        wall_time_s=round(mesh.clock(), 3),
        config=summary(config),
        nodes=results,
        consensus_distance=round(consensus_distance(finals), 8) if finals else None,
        membership_events=[e for n in mesh.nodes for e in n.membership_events()],
    )
    report["average_model"] = average.evaluate(finals)
    report["average_model_timeline"] = live.timeline if live is not None else []
    report["distance_from_average"] = distances_from(final, np.mean(finals, axis=0)) if finals else {}
    report["chaos_events"] = mesh.chaos
    report["chaos_delay_s"] = mesh.chaos_delay_s
    report["links"] = _links(config, mesh.nodes, wire)
    write_json(report_path, report)
    _print_summary(stream, mesh.nodes, results, report, report_path)
    if config.plot != "none":
        plot_path = report_path.with_suffix(".png") if config.plot == "auto" else Path(config.plot)
        print(f"writing plot {plot_path}...", file=stream, flush=True)  # (matplotlib takes seconds)
        report_view.plot(report, plot_path)
        print(f"plot: {plot_path}", file=stream, flush=True)
    return 0 if len(ended) == len(results) else 1


def _watch(
    mesh: Mesh, schedule: list[ChaosAction], stop: threading.Event, table: LiveTable, live: LiveAverage | None
) -> None:
    """Until every node exits: read progress, run the fault schedule, refresh the table (its
    header with the average model's latest estimate); on ``stop``, terminate the nodes (and kill
    them after ``STOP_GRACE_S``)."""
    pending = list(schedule)
    kill_at = None
    apart: dict[str, float] = {}  # each node's distance from the average model, as last estimated
    while pending or mesh.live():
        delay = mesh.schedule_delay(schedule[0].at) if pending else None
        while delay is not None and pending and pending[0].at + delay <= mesh.clock() and not stop.is_set():
            mesh.act(pending.pop(0))
        if stop.is_set() and kill_at is None:
            pending.clear()
            kill_at = time.monotonic() + STOP_GRACE_S
            for node in mesh.nodes:
                node.send_signal(signal.SIGCONT)  # a paused node could not stop
                node.send_signal(signal.SIGTERM)
        if kill_at is not None and time.monotonic() > kill_at:
            for node in mesh.nodes:
                node.send_signal(signal.SIGKILL)
        header = f"t = {mesh.clock():6.1f} s"
        estimate = live.poll({n.id: n.live_params for n in mesh.live()}) if live is not None else None
        if estimate is not None:
            header += f"   average model: accuracy {estimate['accuracy']:.3f} (at {estimate['t']:.1f} s)"
            apart = estimate["distance_from_average"]
        table.update([{**n.row, "from_average": apart.get(n.id)} for n in mesh.nodes], header=header)
        due = pending[0].at + delay - mesh.clock() if pending and delay is not None else _REFRESH_S
        wait = min(_REFRESH_S, max(0.0, due))
        mesh.read_progress(wait)
    mesh.drain()
    rows = [{**n.row, "from_average": apart.get(n.id)} for n in mesh.nodes]
    table.update(rows, header=f"t = {mesh.clock():6.1f} s", force=True)


@contextmanager
def _hosts(config: MeshConfig) -> Iterator[list[netns.Host] | None]:
    """A namespace host per node, joiners' included, their uplinks capped (``--hosts netns``);
    None for 127.0.0.1. Raises ConfigError where namespaces cannot be made."""
    if config.hosts == "local":
        yield None
        return
    why = netns.unavailable()
    if why is not None:
        raise ConfigError(f"--hosts netns: {why}; run as root, or use --hosts local")
    with netns.lan(config.nodes + sum(action.count for action in config.join)) as hosts:
        for rank, host in enumerate(hosts):
            mbps = config.uplink_mbps(rank)
            if mbps is not None:
                netns.cap_bandwidth(host, f"{mbps:g}mbit")
            if rank in config.no_listen and netns.can_refuse_inbound():
                netns.refuse_inbound(host)
        yield hosts


def _links(config: MeshConfig, nodes: list[NodeProcess], wire: dict[str, int]) -> dict[str, Any]:
    """The report's ``links``: where the nodes ran, each node's uplink cap (Mbit/s) and, on
    namespace hosts, the bytes its host sent on its link (``wire_bytes_sent``: frames, headers
    and all, every local rank of a machine's)."""
    links: dict[str, Any] = {
        "hosts": config.hosts,
        "uplink_mbps": {node.id: config.uplink_mbps(node.rank) for node in nodes},
        "no_listen": [node.id for node in nodes if node.rank in config.no_listen],
        "inbound_refused": config.hosts == "netns" and bool(config.no_listen) and netns.can_refuse_inbound(),
    }
    if wire:
        links["wire_bytes_sent"] = wire
    return links


@contextmanager
def _forward_termination(stop: threading.Event) -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM set ``stop`` (the mesh then stops its nodes)."""
    previous = {
        signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _print_summary(
    stream: TextIO,
    nodes: list[NodeProcess],
    results: list[dict[str, Any]],
    report: dict[str, Any],
    report_path: Path,
) -> None:
    accuracies = [r["final"]["accuracy"] for r in results if r["status"] == "finished"]
    killed = sum(r["status"] == "killed" for r in results)
    line = f"\nmesh done in {report['wall_time_s']:.1f} s: {len(accuracies)}/{len(nodes)} nodes finished"
    line += f", {killed} killed" if killed else ""
    if accuracies:
        line += f"; held-out accuracy min {min(accuracies):.3f}, mean {np.mean(accuracies):.3f}"
        if report["average_model"] is not None:
            line += f", of the average model {report['average_model']['accuracy']:.3f}"
            line += f"; consensus distance {report['consensus_distance']:.2e}"
    print(line, file=stream)
    for node, result in zip(nodes, results, strict=True):
        if result["status"] not in ("finished", "killed"):
            print(f"  {node.id} {result['status']}: {result.get('error')}\n{node.log_tail()}", file=stream)
    print(f"report: {report_path}", file=stream, flush=True)
