"""The chaos harness's figures: real daemons on network-namespace hosts, CURVE on, checkpoints
on; kill -9, restart, a partition and its heal, a bandwidth cap, a fuzzer and an intruder.
Needs root (CI has it); skipped with the reason elsewhere."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import netns
import pytest
from host_mesh import HostMesh

pytestmark = [pytest.mark.mesh, pytest.mark.usefixtures("no_other_threads")]


@pytest.fixture(autouse=True)
def hosts_available() -> None:
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)


def events(report: dict[str, Any], event: str, node: str) -> list[float]:
    return [e["t"] for e in report["membership_events"] if e["event"] == event and e["node"] == node]


def sleep_until(mesh: HostMesh, t: float) -> None:
    time.sleep(max(0.0, t - mesh.clock()))


def test_eight_hosts_survive_two_kills_a_restart_from_checkpoint_and_a_fuzzer(tmp_path: Path) -> None:
    with netns.lan(8) as hosts:
        mesh = HostMesh(hosts, tmp_path, "--steps", "600", "--compute-ms", "20")
        t0 = mesh.start_all()
        fuzzer = mesh.fuzz(on_host=7, target=0, count=10_000)
        sleep_until(mesh, t0 + 3)
        mesh.signal(2, signal.SIGKILL)
        mesh.signal(6, signal.SIGKILL)
        killed = mesh.clock()
        sleep_until(mesh, killed + 6)
        restarted_at = mesh.clock()
        mesh.start(6, expect=8, bootstrap=0, logs="restart")  # the same command line, after a crash
        mesh.wait(timeout=90)
        _, status = os.waitpid(fuzzer, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    survivors = [0, 1, 3, 4, 5, 7]
    reports = {i: mesh.report(i) for i in [*survivors, 6]}
    for i in survivors:
        node = reports[i]
        assert node["status"] == "finished" and node["steps"] == 600, node
        assert node["final"]["accuracy"] >= 0.9, node["final"]
        for victim in ("node-2", "node-6"):
            assert [t for t in events(node, "dead", victim) if killed < t < restarted_at], (i, victim)
        assert [t for t in events(node, "joined", "node-6") if t > restarted_at], i  # node-6 is back
    restarted = reports[6]
    assert restarted["resumed_from"] and restarted["t_joined"] > restarted_at
    assert restarted["status"] == "finished" and restarted["final"]["accuracy"] >= 0.9
    assert restarted["timeline"][0]["accuracy"] > 0.5  # from its checkpoint / the mesh, not scratch
    fuzzed = reports[0]["rejected_by_peer"]
    (fuzzer_name,) = [peer for peer in fuzzed if peer.startswith("fuzzer")]
    assert sum(fuzzed[fuzzer_name].values()) == 10_000  # every one counted as rejected...
    assert len(fuzzed[fuzzer_name]) >= 3 and fuzzed[fuzzer_name]["shunned"] > 9000  # ...then shunned
    assert reports[0]["shunned_peers"] == [fuzzer_name]
