"""Hardening of the daemon (issue 16): its HTTP endpoint holds a bounded number of connections
and fails /healthz once the network thread died (11, supervision); two daemons that name each
other start together (13); a SIGTERM cancels a join, the report is written before the params,
and a checkpoint that cannot be written is counted and retried (shutdown and disk faults)."""

from __future__ import annotations

import contextlib
import http.client
import json
import multiprocessing
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers import HANG_S, addresses, started_peers, wait_until

import gossipmesh.daemon.status_server
import gossipmesh.daemon.trainer
import node
from gossipmesh.config import NodeConfig, node_config
from gossipmesh.daemon import lifecycle
from gossipmesh.daemon.lifecycle import join_running_mesh
from gossipmesh.daemon.metrics import NodeMetrics
from gossipmesh.daemon.status_server import MAX_PER_CLIENT, StatusServer
from gossipmesh.sim.memory import MemoryNetwork
from p2p import Peer, TransportError
from p2p.membership.protocol import NOT_YET

pytestmark = pytest.mark.mesh


class _Fault(BaseException):
    """What no handler catches: it stands for a bug that would end the network thread."""


def _die() -> None:
    raise _Fault("injected")


def _status(port: int, path: str) -> int:
    """The HTTP status of a GET, or 0 when the server closed the connection unanswered."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, ConnectionError, http.client.HTTPException):
        return 0


def test_the_status_endpoint_holds_a_bounded_number_of_idle_connections() -> None:
    """100 connections that send nothing hold no thread and at most MAX_PER_CLIENT places: a
    probe from the same address is answered at once."""
    assert node_config(["--insecure"]).metrics_host == "127.0.0.1"
    server = StatusServer(NodeMetrics(stale_after_s=60), 0)
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(100)]
    try:
        assert wait_until(lambda: server.evicted == 100 - MAX_PER_CLIENT)  # all 100 taken in
        assert threading.active_count() == before
        assert _status(server.port, "/healthz") == 200
    finally:
        for connection in idle:
            connection.close()
        server.close()


def test_clients_that_trickle_their_requests_neither_hold_healthz_nor_outlive_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Twice MAX_CONNECTIONS clients sending a byte every 0.2 s: every probe meanwhile is
    answered, and each trickler is closed at the whole-request deadline, not kept by its bytes."""
    monkeypatch.setattr(gossipmesh.daemon.status_server, "REQUEST_DEADLINE_S", 1.0)
    server = StatusServer(NodeMetrics(stale_after_s=60), 0, max_connections=16, max_per_client=16)
    slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(32)]
    probes: list[int] = []
    try:
        for _ in range(10):
            for connection in slow:
                with contextlib.suppress(OSError):
                    connection.send(b"G")
            probes.append(_status(server.port, "/healthz"))
            time.sleep(0.2)
        assert probes == [200] * 10
        assert wait_until(lambda: server.expired >= 1 and not server._open)
        assert server.evicted + server.expired >= 32
    finally:
        for connection in slow:
            connection.close()
        server.close()


def test_healthz_fails_once_the_network_thread_died() -> None:
    with started_peers(["a", "b"]) as (a, _):
        metrics = NodeMetrics(stale_after_s=60)
        metrics.peer = a
        server = StatusServer(metrics, 0, "127.0.0.1")
        try:
            assert _status(server.port, "/healthz") == 200
            a.transport.call_soon(_die)
            assert a.transport.stopped.wait(HANG_S)
            assert _status(server.port, "/healthz") == 503
        finally:
            server.close()


def _run_in_thread(config: NodeConfig, stop: threading.Event) -> dict[str, Any]:
    """``run_node`` on a thread; returns what it returned or raised, once it has."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["record"] = node.run_node(config, stop)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    outcome["thread"] = thread
    return outcome


def test_a_daemon_whose_network_thread_dies_stops_and_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Supervision: the daemon does not train on alone; it fails (exit status 1 from main),
    once: its background threads (the state server's) end quietly instead of each raising the
    network's failure again."""
    unhandled: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: unhandled.append(args.exc_value))
    peers: list[Peer] = []
    make_peer = lifecycle.make_peer
    monkeypatch.setattr(lifecycle, "make_peer", lambda *a, **k: peers.append(make_peer(*a, **k)) or peers[-1])
    report = tmp_path / "report.json"
    config = NodeConfig(
        insecure=True, listen="tcp://127.0.0.1:0", steps=100_000, report=report, progress="none"
    )
    stop = threading.Event()
    outcome = _run_in_thread(config, stop)
    try:
        assert wait_until(lambda: bool(peers) and bool(peers[0].address))
        peers[0].transport.call_soon(_die)
        outcome["thread"].join(HANG_S)
    finally:
        stop.set()  # (should it train on after all, the test ends)
        outcome["thread"].join()
    assert isinstance(outcome.get("error"), TransportError), outcome
    assert "network thread" in str(outcome["error"])
    assert json.loads(report.read_text())["nodes"][0]["status"] == "failed"
    assert not unhandled, unhandled


def test_a_member_still_starting_is_no_state_source() -> None:
    """Item 13: with no member training yet, a joiner takes nobody's state (it starts with the
    members present at round 0)."""
    network = MemoryNetwork()
    network.join("other", first_round=NOT_YET)
    late = network.join("late", first_round=NOT_YET)
    config = NodeConfig(insecure=True, startup_timeout=5)
    task = config.task.make()
    joiner = config.gossip_optimizer(config.local_optimizer(task.model(0)), late)
    started = time.monotonic()
    assert join_running_mesh(late, joiner, 5, lambda: False) is None  # type: ignore[arg-type]
    assert time.monotonic() - started < config.startup_timeout  # it did not wait the timeout out


def _daemon(argv: list[str]) -> None:
    """A daemon in a forked process (one torch thread: the parent's OpenMP pool does not
    survive a fork)."""
    sys.exit(node.main(["node", "--insecure", "--progress", "none", "--threads", "1", *argv]))


def test_two_daemons_that_name_each_other_start_together(tmp_path: Path, no_other_threads: None) -> None:
    """Item 13: the simplest two-terminal start, with no --expect."""
    fork = multiprocessing.get_context("fork")
    listen = addresses(2)
    daemons = []
    for i in range(2):
        argv = ["--listen", listen[i], "--bootstrap", listen[1 - i], "--id", f"n{i}", "--steps", "30",
                "--startup-timeout", "40", "--report", str(tmp_path / f"n{i}.json")]  # fmt: skip
        daemons.append(fork.Process(target=_daemon, args=(argv,)))
        daemons[-1].start()
    started = time.monotonic()
    for daemon in daemons:
        daemon.join(HANG_S)
    assert [d.exitcode for d in daemons] == [0, 0]
    assert time.monotonic() - started < 40  # no startup timeout waited out in between
    for i in range(2):
        record = json.loads((tmp_path / f"n{i}.json").read_text())["nodes"][0]
        assert record["status"] == "finished" and record["steps"] >= 30


def test_sigterm_cancels_a_join_within_the_grace_period(no_other_threads: None) -> None:
    """A joiner waiting for the state of a member that never answers stops at once on SIGTERM
    (Kubernetes kills a pod 10 s after it)."""
    fork = multiprocessing.get_context("fork")
    listen = addresses(2)
    joiner = fork.Process(
        target=_daemon, args=(["--listen", listen[1], "--bootstrap", listen[0], "--id", "joiner"],)
    )
    joiner.start()
    member = Peer("member", listen[0])  # a member that trains (round 0 on) but serves no state
    member.start()
    try:
        assert wait_until(lambda: "joiner" in member.members())
        assert member.recv(30, {"state_request"}) is not None  # it is waiting for the state now
        assert joiner.pid is not None
        terminated = time.monotonic()
        joiner.terminate()
        joiner.join(HANG_S)
        assert joiner.exitcode == 0 and time.monotonic() - terminated < 10  # within the grace
    finally:
        joiner.kill()
        member.close()


def test_the_report_is_written_before_the_parameters(tmp_path: Path) -> None:
    """A --save-params that cannot be written no longer loses the report."""
    (tmp_path / "a-file").write_text("")
    report = tmp_path / "report.json"
    config = NodeConfig(
        insecure=True,
        listen="tcp://127.0.0.1:0",
        steps=5,
        progress="none",
        report=report,
        save_params=tmp_path / "a-file" / "params.npy",
    )
    with pytest.raises(OSError):
        node.run_node(config, threading.Event())
    assert json.loads(report.read_text())["nodes"][0]["status"] == "finished"


def test_a_checkpoint_that_cannot_be_written_is_counted_and_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk (here: a state folder that cannot be made) does not stop training."""
    monkeypatch.setattr(gossipmesh.daemon.trainer, "WRITE_RETRY_S", 0.0)
    (tmp_path / "a-file").write_text("")
    config = NodeConfig(
        insecure=True,
        listen="tcp://127.0.0.1:0",
        steps=30,
        progress="none",
        state_dir=tmp_path / "a-file" / "state",
        checkpoint_every=10,
    )
    record = node.run_node(config, threading.Event())
    assert record.status == "finished" and record.steps == 30
    assert record.checkpoint_failures == 22  # steps 10 to 30 (each failure retried at the next), and the last


def test_a_live_params_copy_that_cannot_be_written_is_counted_and_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29, item 11: a directory at the copy's temporary name (IsADirectoryError) once
    killed the node mid-run; now each timeline point's copy fails, is counted and retried."""
    monkeypatch.setattr(gossipmesh.daemon.trainer, "WRITE_RETRY_S", 0.0)
    live = tmp_path / "live.npy"
    (tmp_path / f".{live.name}.tmp").mkdir()
    config = NodeConfig(
        insecure=True,
        listen="tcp://127.0.0.1:0",
        steps=30,
        progress="none",
        live_params=live,
        eval_interval=0.05,
    )
    record = node.run_node(config, threading.Event())
    assert record.status == "finished" and record.steps == 30
    assert record.live_params_failures == len(record.timeline) >= 2  # every point's copy tried
    assert not live.exists()
