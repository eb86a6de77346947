"""The local test mesh: N daemons as separate OS processes on 127.0.0.1.

Each node runs the daemon's own entry point (``gossipmesh node ...``) with free ports picked for
it, every other node as its bootstrap list, one compute thread and a shared report clock. The
launcher reads the nodes' JSON progress lines into a live table, stops them all on Ctrl-C or
SIGTERM, and merges their reports into one (adding the consensus distance of the final models).

Nodes are forked from the launcher after it has imported what every node needs, as PyTorch's
DataLoader forks its workers: on a machine with few cores, N fresh interpreters each importing
torch would take longer than the training. Each node gets its own session, so a Ctrl-C in the
terminal reaches only the launcher, which then stops the nodes gracefully.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from gossip import consensus_distance
from runtime.config import MeshConfig, as_flags, summary
from runtime.console import LiveTable
from runtime.report import NodeRecord, build_report, read_json, write_json

STOP_GRACE_S = 10.0
_REFRESH_S = 0.25
_LOG_TAIL_LINES = 15

NodeMain = Callable[[Sequence[str]], int]


class NodeProcess:
    """One daemon of the mesh: its process, files and latest progress."""

    def __init__(self, rank: int, address: str, run_dir: Path) -> None:
        self.rank = rank
        self.id = f"node-{rank}"
        self.address = address
        self.log = run_dir / f"{self.id}.log"
        self.report = run_dir / f"{self.id}.json"
        self.params = run_dir / f"{self.id}.npy"
        self.row: dict[str, Any] = {"id": self.id, "rank": rank, "status": "starting"}
        self.exit_code: int | None = None
        self._pid = 0
        self._progress_fd = -1
        self._reader: threading.Thread | None = None

    def start(self, node_main: NodeMain, argv: list[str]) -> None:
        """Fork and run ``node_main(argv)`` with stdout to a pipe and stderr to the log."""
        read_fd, write_fd = os.pipe()
        log_fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pid = os.fork()
        if pid == 0:  # the node
            os.close(read_fd)
            _run_forked(node_main, argv, stdout_fd=write_fd, stderr_fd=log_fd)
        os.close(write_fd)
        os.close(log_fd)
        self._pid, self._progress_fd = pid, read_fd

    def watch(self) -> None:
        """Follow the node's progress lines (start after every node is forked)."""
        self._reader = threading.Thread(target=self._read_progress, name=f"read-{self.id}", daemon=True)
        self._reader.start()

    def finish_reading(self, timeout: float = 5.0) -> None:
        """Wait for the last progress lines of an exited node."""
        if self._reader is not None:
            self._reader.join(timeout)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self._pid, signum)

    def _read_progress(self) -> None:
        with os.fdopen(self._progress_fd) as lines:
            for line in lines:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if event.get("event") == "point":
                    self.row.update(event, status="training")
                elif event.get("event") == "ready":
                    self.row.update(status="ready")

    def poll(self) -> int | None:
        if self.exit_code is None:
            pid, status = os.waitpid(self._pid, os.WNOHANG)
            if pid:
                self.exit_code = os.waitstatus_to_exitcode(status)
                if self.row["status"] in ("starting", "ready", "training"):
                    self.row["status"] = "finished" if self.exit_code == 0 else f"failed ({self.exit_code})"
        return self.exit_code

    def result(self) -> dict[str, Any]:
        """This node's entry of the mesh report (a failed one if it left no report)."""
        if self.report.exists():
            node: dict[str, Any] = read_json(self.report)["nodes"][0]
            return node
        record = NodeRecord(id=self.id, rank=self.rank, address=self.address, status="failed")
        record.error = f"exited with code {self.poll()} without a report; see {self.log}"
        return asdict(record)

    def log_tail(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join("    " + line for line in lines[-_LOG_TAIL_LINES:])


def run_mesh(config: MeshConfig, node_main: NodeMain, stream: TextIO | None = None) -> int:
    """Run the mesh to the end; returns 0 when every node finished.

    ``node_main`` is the daemon's command-line entry point, called in each forked node.
    """
    stream = stream or sys.stdout
    run_dir = config.run_dir or Path("runs") / time.strftime("mesh-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    report_path = config.report or run_dir / "report.json"
    addresses = [f"tcp://127.0.0.1:{port}" for port in free_ports(config.nodes)]
    nodes = [NodeProcess(rank, address, run_dir) for rank, address in enumerate(addresses)]
    slowdown = config.slowdown_by_rank()
    origin = time.time()
    print(
        f"gossipmesh mesh: {config.nodes} nodes, {config.topology} topology, {config.algorithm}, "
        f"task {config.task}; logs in {run_dir}",
        file=stream,
        flush=True,
    )
    stop = threading.Event()
    stream.flush()  # a buffered line would be written again by every forked node
    with _forward_termination(stop):
        for node in nodes:
            argv = [
                "node",
                "--id", node.id,
                "--listen", node.address,
                "--bootstrap", ",".join(a for a in addresses if a != node.address),
                "--report", str(node.report),
                "--save-params", str(node.params),
                "--progress", "json",
                "--clock-origin", repr(origin),
                "--slowdown", str(slowdown.get(node.rank, 1.0)),
                "--threads", "1",
                *as_flags(config),
            ]  # fmt: skip
            node.start(node_main, argv)
        for node in nodes:
            node.watch()
        _watch(nodes, stop, LiveTable(stream, interactive=stream.isatty()), origin)
    wall_time_s = time.time() - origin
    results = [node.result() for node in nodes]
    finished = [node for node, result in zip(nodes, results, strict=True) if result["status"] == "finished"]
    distance = _consensus([node.params for node in finished if node.params.exists()])
    report = build_report(
        wall_time_s=round(wall_time_s, 3), config=summary(config), nodes=results, consensus_distance=distance
    )
    write_json(report_path, report)
    _print_summary(stream, nodes, results, report, report_path)
    return 0 if len(finished) == len(nodes) else 1


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 right now (held together while picked, so all distinct)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def _watch(nodes: list[NodeProcess], stop: threading.Event, table: LiveTable, origin: float) -> None:
    """Refresh the table until every node exits; on ``stop``, terminate them (then kill)."""
    kill_at = None
    while any(node.poll() is None for node in nodes):
        if stop.is_set() and kill_at is None:
            kill_at = time.monotonic() + STOP_GRACE_S
            for node in nodes:
                node.send_signal(signal.SIGTERM)
        if kill_at is not None and time.monotonic() > kill_at:
            for node in nodes:
                node.send_signal(signal.SIGKILL)
        table.update([n.row for n in nodes], header=f"t = {time.time() - origin:6.1f} s")
        time.sleep(_REFRESH_S)
    for node in nodes:
        node.finish_reading()
    table.update([n.row for n in nodes], header=f"t = {time.time() - origin:6.1f} s", force=True)


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


def _run_forked(node_main: NodeMain, argv: list[str], *, stdout_fd: int, stderr_fd: int) -> None:
    """The body of a forked node: its own session, its own stdout and stderr; never returns."""
    code = 1
    try:
        os.setsid()
        os.dup2(stdout_fd, 1)
        os.dup2(stderr_fd, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives until _exit
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        code = node_main(argv)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _consensus(param_files: list[Path]) -> float | None:
    if not param_files:
        return None
    vectors = [np.load(path, allow_pickle=False) for path in param_files]
    return round(consensus_distance(vectors), 8)


def _print_summary(
    stream: TextIO,
    nodes: list[NodeProcess],
    results: list[dict[str, Any]],
    report: dict[str, Any],
    report_path: Path,
) -> None:
    accuracies = [r["final"]["accuracy"] for r in results if r["status"] == "finished"]
    finished = len(accuracies)
    line = f"\nmesh done in {report['wall_time_s']:.1f} s: {finished}/{len(nodes)} nodes finished"
    if accuracies:
        line += (
            f"; held-out accuracy min {min(accuracies):.3f}, mean {np.mean(accuracies):.3f}; "
            f"consensus distance {report['consensus_distance']:.2e}"
        )
    print(line, file=stream)
    for node, result in zip(nodes, results, strict=True):
        if result["status"] != "finished":
            print(f"  {node.id} {result['status']}: {result.get('error')}\n{node.log_tail()}", file=stream)
    print(f"report: {report_path}", file=stream, flush=True)
