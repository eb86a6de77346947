"""Discovery across real hosts (network namespaces on one LAN): by UDP beacon alone, and by one
DNS name that resolves to every node (as a Kubernetes headless Service does); a beacon heard
before a node's first tick."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
from helpers import HANG_S, wait_until
from hostile import forge_beacon, free_udp_port

from gossip.algorithms.registry import AUTO_LOCAL_STEPS
from gossipmesh.mesh import netns
from p2p import Peer
from p2p.membership.beacon import parse_beacon
from p2p.security.curve import keygen

NODE_PY = str(Path(__file__).resolve().parents[1] / "node.py")


def test_beacons_of_other_meshes_and_garbage_are_ignored() -> None:
    good = msgpack.packb({"v": 1, "mesh": "m", "id": "a", "address": "tcp://10.0.0.1:7000"})
    assert parse_beacon(good, "m") == ("a", "tcp://10.0.0.1:7000", "")
    assert parse_beacon(good, "other") is None
    assert parse_beacon(b"\xc1junk", "m") is None
    assert parse_beacon(msgpack.packb({"v": 1, "mesh": "m", "id": "bad id", "address": "x"}), "m") is None
    assert parse_beacon(b"x" * 600, "m") is None


def test_a_node_that_hears_a_beacon_as_it_starts_announces_its_real_address() -> None:
    """A beacon waiting in a's socket is read before a's first tick: the table a sends to b
    carried a's record with the placeholder address, which b took as that life's address for
    good (a's real one was then a conflict, and a was declared dead)."""
    port = free_udp_port()
    b = Peer("b", "tcp://127.0.0.1:0")
    a = Peer("a", "tcp://127.0.0.1:0", beacon_port=port)
    try:
        b.start()
        forge_beacon(port, node_id="b", address=b.address)  # b's beacon, in a's socket before a starts
        a.start()
        assert wait_until(lambda: b.membership.contact("a") is not None)
        assert b.membership.contact("a") == (a.address, "")
        assert wait_until(lambda: a.members() == b.members() == {"a", "b"})
        assert b.stats.rejected == {}
    finally:
        a.close()
        b.close()


def run_hosts(hosts: list[netns.Host], tmp_path: Path, *flags: str) -> list[dict[str, Any]]:
    """One daemon per host (ids host-I, port 7000, 3 expected, 60 steps, CURVE keys); their
    reports."""
    processes = []
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    for i in range(len(hosts)):
        public, _ = keygen(tmp_path / f"host-{i}", f"host-{i}")
        shutil.copy(public, trusted)
    for i, host in enumerate(hosts):
        argv = [
            sys.executable, NODE_PY, "node",
            "--id", f"host-{i}",
            "--keys", str(tmp_path / f"host-{i}"),
            "--trusted", str(trusted),
            "--listen", f"tcp://{host.address}:7000",
            "--expect", str(len(hosts)),
            "--steps", "60",
            "--report", str(tmp_path / f"host-{i}.json"),
            *flags,
        ]  # fmt: skip
        command = host.command(argv)
        processes.append(
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        )
    errors = []
    for process in processes:
        _, err = process.communicate(timeout=HANG_S)
        errors.append(err)
    assert all(p.returncode == 0 for p in processes), "\n---\n".join(e[-1500:] for e in errors)
    return [json.loads((tmp_path / f"host-{i}.json").read_text()) for i in range(len(hosts))]


def check_mesh_of(reports: list[dict[str, Any]], hosts: list[netns.Host]) -> None:
    assert sorted(r["nodes"][0]["rank"] for r in reports) == list(range(len(hosts)))
    for i, report in enumerate(reports):
        node = report["nodes"][0]
        assert node["status"] == "finished" and node["steps"] == 60
        assert node["address"] == f"tcp://{hosts[i].address}:7000"
        joined = {e["node"] for e in report["membership_events"] if e["event"] == "joined"}
        assert joined == {f"host-{j}" for j in range(len(hosts))} - {f"host-{i}"}
        assert node["bytes_received"] > 60 // AUTO_LOCAL_STEPS * 4 * 9610  # it averaged with them


@pytest.fixture
def hosts_available() -> None:
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)


@pytest.mark.mesh
def test_three_hosts_find_each_other_by_beacon(tmp_path: Path, hosts_available: None) -> None:
    with netns.lan(3) as hosts:
        reports = run_hosts(hosts, tmp_path, "--beacon", "7946")
    check_mesh_of(reports, hosts)


@pytest.mark.mesh
def test_one_dns_name_for_every_node_is_enough(tmp_path: Path, hosts_available: None) -> None:
    names = "".join(f"{netns.SUBNET}.{i + 1} mesh.example\n" for i in range(3))
    with netns.lan(3, hosts_file=f"127.0.0.1 localhost\n{names}") as hosts:
        reports = run_hosts(hosts, tmp_path, "--bootstrap", "tcp://mesh.example:7000")
    check_mesh_of(reports, hosts)
