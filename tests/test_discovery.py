"""Zero-configuration discovery: daemons on separate hosts (network namespaces on one LAN)
find each other by UDP beacon alone, with no bootstrap address."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgpack
import netns
import pytest

from p2p.beacon import parse_beacon

NODE_PY = str(Path(__file__).resolve().parents[1] / "node.py")


def test_beacons_of_other_meshes_and_garbage_are_ignored() -> None:
    good = msgpack.packb({"v": 1, "mesh": "m", "id": "a", "address": "tcp://10.0.0.1:7000"})
    assert parse_beacon(good, "m") == ("a", "tcp://10.0.0.1:7000")
    assert parse_beacon(good, "other") is None
    assert parse_beacon(b"\xc1junk", "m") is None
    assert parse_beacon(msgpack.packb({"v": 1, "mesh": "m", "id": "bad id", "address": "x"}), "m") is None
    assert parse_beacon(b"x" * 600, "m") is None


@pytest.mark.mesh
def test_three_hosts_find_each_other_by_beacon(tmp_path: Path) -> None:
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with netns.lan(3) as hosts:
        processes = [
            subprocess.Popen(
                host.command(
                    [
                        sys.executable,
                        NODE_PY,
                        "node",
                        "--id",
                        f"host-{i}",
                        "--listen",
                        f"tcp://{host.address}:7000",
                        "--beacon",
                        "7946",
                        "--expect",
                        "3",
                        "--steps",
                        "60",
                        "--startup-timeout",
                        "60",
                        "--report",
                        str(tmp_path / f"host-{i}.json"),
                    ]
                ),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i, host in enumerate(hosts)
        ]
        for process in processes:
            _, err = process.communicate(timeout=180)
            assert process.returncode == 0, err[-3000:]
    reports = [json.loads((tmp_path / f"host-{i}.json").read_text()) for i in range(3)]
    assert sorted(r["nodes"][0]["rank"] for r in reports) == [0, 1, 2]
    for i, report in enumerate(reports):
        node = report["nodes"][0]
        assert node["status"] == "finished" and node["steps"] == 60
        assert node["address"] == f"tcp://{hosts[i].address}:7000"
        joined = {e["node"] for e in report["membership_events"] if e["event"] == "joined"}
        assert joined == {f"host-{j}" for j in range(3)} - {f"host-{i}"}
        assert node["bytes_received"] > 60 * 4 * 9610  # it averaged with its ring neighbours
